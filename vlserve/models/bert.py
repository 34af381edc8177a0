"""BERT encoders for the pooling runner: sentence-transformers embedders (`BertModel`, e.g. all-MiniLM) and
cross-encoder rerankers (`BertForSequenceClassification`, e.g. ms-marco-MiniLM), from checkpoints as HF writes them.

    pool_prompts(token_ids: list of [T_i] int64, spec: PoolerSpec) -> [N, D] float32 (BertModel: D = hidden size)
                                                                    [N, L] float32 (classifier: its logits)

Every prompt is encoded whole in one call, all prompts concatenated into one varlen batch (rows R = sum T_i): word +
absolute position + token type embeddings, then post-LN blocks (x = LN(x + attn(x)); x = LN(x + mlp(x))) whose
attention is bidirectional within each prompt. Token types follow from the ids as a BERT tokenizer's text pair
writes them: 0 up to and including the first [SEP], 1 after. The embedder pools the last hidden states as
`spec.pooling_type` says (CLS, MEAN or LAST; sentence-transformers' `1_Pooling` decides which); the classifier pools
the same way, then applies its pooler (dense + tanh) and `classifier` linear, so with CLS it is HF's
BertForSequenceClassification. No KV cache: the capabilities say `pooling=True, kv_free=True`.
Module names follow HF's (`embeddings.word_embeddings`, `encoder.layer.N.attention.self.query`, ...) so weights
load by name; the linears are PackableLinears (`encoder_parts()` names what takes many rows a call).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch
from torch import nn

from vlserve.kernels import varlen_attention
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import ModelCapabilities
from vlserve.pooling_params import PoolerSpec

BERT_CAPABILITIES = ModelCapabilities(pooling=True, kv_free=True)
# names some checkpoints carry that hold nothing we compute with: saved position-id buffers, pretraining heads
_IGNORED_SUFFIXES = ("position_ids",)
_IGNORED_PREFIXES = ("cls.",)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json")


@functools.lru_cache(maxsize=8)
def _tokenizer_sep_token_id(path: str) -> int | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path).sep_token_id
    except (OSError, ValueError):
        return None


def sep_token_id_of(config) -> int:
    """The [SEP] id token types switch after: the config's `sep_token_id` where it states one, else that of the
    tokenizer saved beside the config (`config.name_or_path`); ValueError when neither says."""
    stated = getattr(config, "sep_token_id", None)
    if stated is not None:
        return int(stated)
    path = getattr(config, "name_or_path", "") or ""
    saved = os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)
    found = _tokenizer_sep_token_id(os.path.abspath(path)) if saved else None  # never a hub id nor a bare default
    if found is None:
        raise ValueError(
            f"cannot tell the BERT [SEP] token id: the config states no sep_token_id and no tokenizer with one is "
            f"saved at {path!r}"
        )
    return int(found)


def check_bert_config(config) -> None:
    """ValueError for a BERT config this encoder does not compute as HF does."""
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"BERT position_embedding_type {kind!r} is not supported (absolute only)")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("a BERT decoder (is_decoder / add_cross_attention) is not supported: encoders only")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size {config.hidden_size} does not split into {config.num_attention_heads} heads")


class Segments:
    """The prompts of one call as rows of one batch (on the CPU until `to(device)`): `ids [R]` (the prompts
    concatenated), per row its position and token type `[R]` int64; `bounds` (prompt i is rows
    bounds[i]:bounds[i+1]), `cu_seqlens [N+1]` int32, `lengths [N]`, `first_rows` / `last_rows [N]`."""

    def __init__(self, token_ids: list[torch.Tensor], sep_token_id: int, type_vocab_size: int) -> None:
        lengths = torch.tensor([int(t.numel()) for t in token_ids])  # [N]
        ids = torch.cat([t.cpu().long() for t in token_ids])  # [R]
        self.bounds = [0] + torch.cumsum(lengths, 0).tolist()
        self.max_len = int(lengths.max())
        starts = torch.tensor(self.bounds[:-1]).repeat_interleave(lengths)  # [R]: each row's prompt start
        is_sep = (ids == sep_token_id).long()
        seps_before = torch.cumsum(is_sep, 0) - is_sep  # [R]: [SEP]s strictly before each row, whole batch
        seps_before = seps_before - seps_before[starts]  # ... within its own prompt
        # 0 up to and including the first [SEP], 1 after
        token_types = (seps_before > 0).long().clamp_(max=type_vocab_size - 1)
        self.ids = ids
        self.positions = torch.arange(len(ids)) - starts  # [R]
        self.token_types = token_types
        self.cu_seqlens = torch.tensor(self.bounds, dtype=torch.int32)  # [N+1]
        self.lengths = lengths
        self.first_rows = self.cu_seqlens[:-1].long()  # [N]
        self.last_rows = self.cu_seqlens[1:].long() - 1  # [N]

    _TENSORS = ("ids", "positions", "token_types", "cu_seqlens", "lengths", "first_rows", "last_rows")

    def to(self, device) -> Segments:
        """Move every tensor to `device` (in place); returns self."""
        for name in self._TENSORS:
            setattr(self, name, getattr(self, name).to(device))
        return self


class BertEmbeddings(nn.Module):
    """word + position + token type embeddings, then LayerNorm."""

    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, ids: torch.Tensor, segments: Segments) -> torch.Tensor:
        # ids: [R] -> [R, E]
        x = self.word_embeddings(ids) + self.position_embeddings(segments.positions)
        return self.LayerNorm(x + self.token_type_embeddings(segments.token_types))


class BertSelfAttention(nn.Module):
    """query / key / value projections and bidirectional varlen attention within each prompt."""

    def __init__(self, config) -> None:
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = width // self.num_heads
        self.query = PackableLinear(width, width)
        self.key = PackableLinear(width, width)
        self.value = PackableLinear(width, width)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        # x: [R, E] -> [R, E]
        rows = x.shape[0]
        q = self.query(x).view(rows, self.num_heads, self.head_dim)  # [R, H, Hd]
        k = self.key(x).view(rows, self.num_heads, self.head_dim)
        v = self.value(x).view(rows, self.num_heads, self.head_dim)
        bounds, scale = segments.bounds, self.head_dim**-0.5
        out = varlen_attention(q, k, v, segments.cu_seqlens, scale, max_seqlen=segments.max_len, cu_seqlens_cpu=bounds)
        return out.reshape(rows, -1)  # [R, H, Hd] -> [R, E]


class BertDenseNorm(nn.Module):
    """`dense` then LayerNorm over the residual: LN(residual + dense(x)) (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = PackableLinear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        return self.output(self.self(x, segments), x)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = PackableLinear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))  # [R, E] -> [R, I]


class BertLayer(nn.Module):
    """Post-LN block: x = LN(x + attention(x)); x = LN(x + output(act(intermediate(x))))."""

    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = self.attention(x, segments)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, segments)
        return x


class BertPooler(nn.Module):
    """dense + tanh over a pooled state (HF applies it to the [CLS] token)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = PackableLinear(config.hidden_size, config.hidden_size)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(pooled))  # [N, E] -> [N, E]


class BertTrunk(nn.Module):
    """HF's BertModel over a varlen batch of whole prompts: embeddings and encoder layers (the `pooler`, built only
    `with_pooler`, is the caller's to apply)."""

    def __init__(self, config, with_pooler: bool) -> None:
        super().__init__()
        check_bert_config(config)
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if with_pooler else None

    def segments(self, token_ids: list[torch.Tensor], sep_token_id: int) -> Segments:
        """Check `token_ids` (ValueError: not a non-empty list of non-empty 1-D integer tensors of in-vocabulary
        ids within the position table) and lay them out as one batch."""
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("pool_prompts needs a non-empty list of 1-D token-id tensors")
        cfg = self.config
        for ids in token_ids:
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
                raise ValueError("every prompt must be a non-empty 1-D tensor of token ids")
            if ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise ValueError(f"token ids must be integers, got {ids.dtype}")
            if ids.numel() > cfg.max_position_embeddings:
                raise ValueError(
                    f"a prompt of {ids.numel()} tokens exceeds the {cfg.max_position_embeddings} positions"
                )
        segments = Segments(list(token_ids), sep_token_id, cfg.type_vocab_size)
        if int(segments.ids.min()) < 0 or int(segments.ids.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
        return segments.to(self.embeddings.word_embeddings.weight.device)

    def forward(self, segments: Segments) -> torch.Tensor:
        """The prompts' last hidden states `[R, E]` (rows laid out by `segments`)."""
        return self.encoder(self.embeddings(segments.ids, segments), segments)


POOLING_TYPES = ("CLS", "MEAN", "LAST")


def check_spec(spec: PoolerSpec, model_name: str, has_classifier: bool) -> None:
    """ValueError for a pooler spec a BERT model cannot serve: ALL pooling, LM-head rows (`classifier_token_ids`:
    BERT has no LM head), or task classify without a classifier head."""
    if spec.pooling_type not in POOLING_TYPES:
        raise ValueError(f"a BERT encoder pools {', '.join(POOLING_TYPES)}, not {spec.pooling_type!r}")
    if spec.classifier_token_ids:
        raise ValueError(f"{model_name} has no language-model head to score with classifier_from_token")
    if spec.task == "classify" and not has_classifier:
        raise ValueError(f"{model_name} has no classifier head: serve a BertForSequenceClassification checkpoint")


def pool_rows(hidden: torch.Tensor, segments: Segments, pooling_type: str) -> torch.Tensor:
    """`hidden [R, E]` -> one float32 row per prompt `[N, E]`: its first token (CLS), the mean of its tokens
    (MEAN) or its last token (LAST); ValueError for ALL or anything else."""
    if pooling_type == "CLS":
        return hidden[segments.first_rows].float()
    if pooling_type == "LAST":
        return hidden[segments.last_rows].float()
    if pooling_type == "MEAN":
        prompt_of_row = torch.repeat_interleave(
            torch.arange(len(segments.bounds) - 1, device=hidden.device), segments.lengths
        )  # [R]
        sums = torch.zeros(len(segments.bounds) - 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, prompt_of_row, hidden.float())  # [N, E]
        return sums / segments.lengths[:, None].float()
    raise ValueError(f"a BERT encoder pools {', '.join(POOLING_TYPES)}, not {pooling_type!r}")


def load_named(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...] = ()) -> None:
    """Fill every parameter of `module` from HF-named tensors (old `LayerNorm.gamma` / `.beta` names read as
    weight / bias); names starting with `skip` or `cls.` (pretraining heads) and saved position ids are passed
    over. ValueError on an unknown name, a shape mismatch, or a parameter left unfilled."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or name.startswith(_IGNORED_PREFIXES + skip):
            continue
        key = name.removesuffix(".gamma") + ".weight" if name.endswith(".gamma") else name
        key = key.removesuffix(".beta") + ".bias" if key.endswith(".beta") else key
        if key not in params:
            raise ValueError(f"unexpected weight {name!r} for {type(module).__name__}")
        if tuple(params[key].shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
        params[key].data.copy_(tensor)
        loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing[:8])}")


class _BertPoolingModel(nn.Module):
    """What both BERT pooling models share: no KV cache, no generation path."""

    capabilities = BERT_CAPABILITIES

    @classmethod
    def capabilities_for(cls, hf_config) -> ModelCapabilities:
        """`capabilities` as stated (no value depends on the config)."""
        return cls.capabilities

    def forward(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a BERT encoder for pooling: call pool_prompts")

    def compute_logits(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a BERT encoder and has no language-model head")

    def tie_weights(self) -> None:
        """Nothing is tied."""


class BertEmbeddingModel(_BertPoolingModel):
    """HF `BertModel` checkpoints (sentence-transformers embedders): the last hidden states pooled as the spec says;
    the checkpoint's `pooler.*` (HF's pooler_output, which sentence-transformers does not read) is not loaded.
    Weight names carry no prefix (a `bert.` one is accepted too); the module is `bert`."""

    capabilities = BERT_CAPABILITIES

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.sep_token_id = sep_token_id_of(config)
        self.bert = BertTrunk(config, with_pooler=False)

    def encoder_parts(self) -> list[nn.Module]:
        """`bert`: every prompt token is a row (`pack_linears_for_cpu(model, many_rows=model.encoder_parts())`)."""
        return [self.bert]

    @torch.no_grad()
    def pool_prompts(self, token_ids: list[torch.Tensor], spec: PoolerSpec) -> torch.Tensor:
        """One embedding per prompt `[N, E]` float32 (unnormalized; the front end normalizes as PoolingParams say);
        ValueError for a spec it cannot serve (`check_spec`) or bad ids."""
        check_spec(spec, type(self).__name__, has_classifier=False)
        segments = self.bert.segments(token_ids, self.sep_token_id)
        return pool_rows(self.bert(segments), segments, spec.pooling_type)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill `bert` from HF BertModel names (`embeddings.*`, `encoder.layer.N.*`, optionally `bert.`-prefixed);
        ValueError as `load_named` says."""
        renamed = (("bert." + name.removeprefix("bert."), tensor) for name, tensor in weights)
        load_named(self, renamed, skip=("bert.pooler.",))


class BertForSequenceClassification(_BertPoolingModel):
    """HF `BertForSequenceClassification` checkpoints (cross-encoders): `bert`'s last hidden states pooled as the
    spec says (CLS for HF's), then `bert.pooler` (dense + tanh) and `classifier` -> logits `[N, num_labels]`."""

    capabilities = BERT_CAPABILITIES

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.sep_token_id = sep_token_id_of(config)
        self.bert = BertTrunk(config, with_pooler=True)
        self.classifier = PackableLinear(config.hidden_size, config.num_labels)

    def encoder_parts(self) -> list[nn.Module]:
        """`bert`: every prompt token is a row (`pack_linears_for_cpu(model, many_rows=model.encoder_parts())`)."""
        return [self.bert]

    @torch.no_grad()
    def pool_prompts(self, token_ids: list[torch.Tensor], spec: PoolerSpec) -> torch.Tensor:
        """Task classify: the classifier's logits per prompt `[N, num_labels]` float32 (before any activation);
        task embed: the pooled last hidden states `[N, E]`. ValueError for a spec it cannot serve or bad ids."""
        check_spec(spec, type(self).__name__, has_classifier=True)
        segments = self.bert.segments(token_ids, self.sep_token_id)
        pooled = pool_rows(self.bert(segments), segments, spec.pooling_type)  # [N, E]
        if spec.task != "classify":
            return pooled
        dtype = self.classifier.bias.dtype
        return self.classifier(self.bert.pooler(pooled.to(dtype))).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill everything from HF names: `bert.embeddings.*`, `bert.encoder.*`, `bert.pooler.dense.*`,
        `classifier.*`; ValueError as `load_named` says."""
        load_named(self, weights)
