"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache; sliding-window layers (Mistral,
Qwen2/Qwen3 with `use_sliding_window`) pass their window to the attention kernels (`hf_config.sliding_window_of`).

Tokens of a step are flattened: `T` tokens, `H` hidden, `Hq`/`Hkv` heads, `D` head dim, `I` MLP width.
q/k/v are fused into one `qkv_proj` Linear and gate/up into one `gate_up_proj`; weights keep HF names in the
checkpoint and are sliced into the fused matrices by `load_weights`.

`LlamaDecoderModel` (embeddings + layers + final norm) is built from a text config object alone and accepts
`inputs_embeds` and M-RoPE positions `[3, T]`, so multimodal models (Qwen2-VL) reuse it as their language model.

Under tensor parallelism (vlserve.distributed) the decoder is sharded Megatron-style by
`vlserve.models.parallel_layers`: heads, MLP width and vocab split by rank; `checkpoint_shard(name)` tells the
loader which slice of each checkpoint tensor this rank reads. With one rank nothing changes.

Under pipeline parallelism (`vlserve.distributed.pipeline`) a stage builds only its run of layers (the others are
`AbsentOnStage` placeholders without weights, whose checkpoint tensors the loader skips), the embeddings on the first
stage and the final norm on the last; a later stage's forward takes the previous one's `IntermediateTensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from vlserve import kernels
from vlserve.distributed.parallel_state import tp_size
from vlserve.distributed.pipeline import IntermediateTensors, is_first_stage, is_last_stage, stage_layer_range
from vlserve.kernels.attention_op import paged_attention
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.hf_config import sliding_window_of, text_config_of
from vlserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from vlserve.models.parallel_layers import (
    QKVParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    check_tensor_parallel_sizes,
    copy_weight,
    local_kv_heads,
)

# HF checkpoint names that carry no weights we need (old checkpoints saved RoPE buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Per-tensor FP8 KV-cache scales (compressed-tensors' kv_cache_scheme; older FP8 checkpoints: the k/v projections'
# output_scale, or one kv_scale) -> the attention attributes they set; used only by FP8 caches (kernels.kv_quant).
_KV_SCALE_SUFFIXES = {
    "self_attn.k_scale": ("k_scale",),
    "self_attn.v_scale": ("v_scale",),
    "self_attn.k_proj.output_scale": ("k_scale",),
    "self_attn.v_proj.output_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
}
# HF projections that live inside our fused matrices: HF name -> (module kind in the name, fused parameter).
_FUSED_PIECES = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
}


# (text config, layer index) -> the layer's FFN module, or None for the dense GatedMLP (MoE models pass one).
MlpFactory = Callable[[object, int], "nn.Module | None"]


def head_dim_of(config) -> int:
    """Per-head dim: `config.head_dim` when set, else hidden_size // num_attention_heads (HF's rule)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_spec(hf_config) -> tuple[int, int, int]:
    """`(num_layers, num_kv_heads, head_dim)` of the (text part of the) model: each layer's KV cache is a pair
    `k_cache, v_cache` of shape `[NB, BS, num_kv_heads, head_dim]` in the model dtype. `num_kv_heads` is this
    tensor-parallel rank's (Hkv / tp, or 1 when the KV heads are replicated)."""
    cfg = text_config_of(hf_config)
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg.num_hidden_layers, local_kv_heads(num_kv_heads, tp_size()), head_dim_of(cfg)


class AbsentOnStage(nn.Module):
    """Stands for a module another pipeline stage holds: no weights, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class DecoderAttention(nn.Module):
    """Self-attention: fused qkv projection, optional per-head q/k RMSNorm (Qwen3), RoPE, paged attention, o_proj.

    Head counts are this tensor-parallel rank's (`qkv_proj` splits them; `o_proj` sums the ranks' outputs)."""

    def __init__(
        self, config, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, layer_idx: int = 0
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.k_scale = self.v_scale = 1.0  # FP8 KV cache scales (the checkpoint's, if any): stored x / scale
        self.sliding_window = sliding_window_of(config, layer_idx)  # W: queries see their last W positions; None: all

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        attn_metadata: AttentionMetadata | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Eager: the kernels run in place on `kv_cache` with `attn_metadata`. Compiled (`torch.compiler.
        is_compiling()`): plain-torch rotary and the opaque `vlserve::paged_attention` op, which takes the caches
        and metadata from `kernels.attention_op.attention_step` (both arguments are then ignored). `rows [K]`: only
        those rows of the attention output go through o_proj (every row's K and V are still written)."""
        # hidden: [T, H] -> qkv: [T, (Hq + 2*Hkv) * D] -> q [T,Hq,D], k/v [T,Hkv,D] -> out [T, Hq*D] -> [T|K, H]
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if torch.compiler.is_compiling():
            q, k = self.rotary[0].forward_native(positions, q, k)
            out = paged_attention(
                q, k, v, self.layer_idx, self.scale, self.k_scale, self.v_scale, self.sliding_window
            )  # [T, Hq, D]
            return self.o_proj(out.reshape(T, self.q_size))
        self.rotary[0](positions, q, k)  # in place
        k_cache, v_cache = kv_cache
        out = kernels.attention_forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            attn_metadata,
            self.scale,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sliding_window=self.sliding_window,
        )
        out = out.reshape(T, self.q_size)
        return self.o_proj(out if rows is None else out.index_select(0, rows))


class DecoderLayer(nn.Module):
    """Pre-norm block: `h = x + attn(norm(x)); out = h + mlp(norm(h))`, residual adds fused into the norms."""

    takes_output_rows = True  # forward's `rows`: the block's output at those rows alone

    def __init__(
        self,
        config,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        layer_idx: int = 0,
        mlp_factory: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary, qkv_bias, o_bias, qk_norm, layer_idx)
        mlp = mlp_factory(config, layer_idx) if mlp_factory is not None else None
        self.mlp = (
            mlp
            if mlp is not None
            else GatedMLP(
                config.hidden_size,
                config.intermediate_size,
                getattr(config, "hidden_act", "silu"),
                bias=bool(getattr(config, "mlp_bias", False)),
            )
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ):
        """`(hidden [T,H], residual [T,H] | None) -> (mlp_out [T,H], residual [T,H])`; the sum is the block output.
        With `rows [K]`: both `[K, H]`, the block output at those rows (attention still reads every row)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)  # [K, H]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderModel(nn.Module):
    """Embedding + decoder layers + final norm of a Llama-style model, built from a text config.

    Weight names (as in HF, relative to this module): `embed_tokens.weight`, `norm.weight`,
    `layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`, `layers.{i}.self_attn.{q,k}_norm.weight` (Qwen3),
    `layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`.
    Biases default to `config.attention_bias` (qkv and o); Qwen2 passes `qkv_bias=True, o_bias=False`.
    """

    # Subclass seams (Gemma 3): same-signature embedding/block/norm classes; `rotary_cls(config)` goes to each layer
    embedding_cls, layer_cls, norm_cls, rotary_cls = VocabParallelEmbedding, DecoderLayer, RMSNorm, RotaryEmbedding

    def __init__(
        self,
        config,
        *,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        mlp_factory: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        o_bias = attention_bias if o_bias is None else o_bias
        check_tensor_parallel_sizes(
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            config.intermediate_size,
            tp_size(),
        )
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        # this pipeline stage's layers [start_layer, end_layer) (all of them without pipeline parallelism)
        self.start_layer, self.end_layer = stage_layer_range(self.num_layers)
        self.first_stage, self.last_stage = is_first_stage(), is_last_stage()
        self.embed_tokens = (
            self.embedding_cls(config.vocab_size, config.hidden_size) if self.first_stage else AbsentOnStage()
        )
        self.rotary_emb = self.rotary_cls(config)
        self.layers = nn.ModuleList(
            self.layer_cls(config, self.rotary_emb, qkv_bias, o_bias, qk_norm, i, mlp_factory)
            if self.start_layer <= i < self.end_layer
            else AbsentOnStage()
            for i in range(self.num_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps) if self.last_stage else AbsentOnStage()
        # EAGLE drafts read intermediate states: layer ids i whose INPUT (the residual stream after layer i - 1;
        # 0 = the embeddings, num_layers = the final stream before the last norm) `forward` keeps in
        # `aux_hidden_states` (a list in this order). Empty = nothing kept (the default).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def set_aux_hidden_state_layers(self, layer_ids) -> None:
        """Keep the residual stream at the input of these layers on every forward (see `aux_hidden_states`)."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux hidden state layer ids {bad} out of range [0, {self.num_layers}]")
        self.aux_hidden_state_layers = ids
        self.aux_hidden_states = []

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [T]` -> `[T, H]`."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        layer_additions: list[torch.Tensor] | None = None,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`input_ids [T]` (or `inputs_embeds [T,H]`), `positions [T]|[3,T]` -> final-normed hidden `[T, H]`
        (`[K, H]`: the rows of `attn_metadata.output_rows`, where the last layer takes them). `layer_additions[i]
        [T, H]` is added to the output of layer i (Qwen3-VL's DeepStack features; zero rows for text tokens).
        Pipeline stages: a later stage starts from `intermediate` (the previous stage's output); every stage but the
        last returns its `IntermediateTensors` instead of normed hidden states."""
        if self.first_stage:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            residual = None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual  # [T, H] each
        want = self.aux_hidden_state_layers
        kept: dict[int, torch.Tensor] = {}
        additions = layer_additions or []
        for i in range(self.start_layer, self.end_layer):
            layer = self.layers[i]
            if i in want:
                kept[i] = hidden if residual is None else hidden + residual
            kv_cache = kv_caches[i] if kv_caches is not None else None  # None when compiled (see DecoderAttention)
            layer_md = attn_metadata.for_layer(i) if attn_metadata is not None else None  # its KV group's view
            rows = self._output_rows(i, attn_metadata, len(additions))
            if rows is None:
                hidden, residual = layer(positions, hidden, residual, kv_cache, layer_md)
            else:
                hidden, residual = layer(positions, hidden, residual, kv_cache, layer_md, rows)
            if i < len(additions):  # the block output, then the addition (HF's order of the two sums)
                hidden, residual = (residual + hidden) + additions[i], None
        if not self.last_stage:
            return IntermediateTensors(hidden, torch.zeros_like(hidden) if residual is None else residual)
        hidden, stream = self.norm(hidden, residual) if residual is not None else (self.norm(hidden), hidden)
        if want:
            kept[self.num_layers] = stream
            self.aux_hidden_states = [kept[i] for i in want]
        return hidden

    def _output_rows(self, i: int, attn_metadata: AttentionMetadata | None, num_additions: int) -> torch.Tensor | None:
        """The rows layer i computes alone: the metadata's `output_rows` at the model's last layer, when that layer
        takes them, nothing is added after it and no stream is kept for a draft; else None (every row)."""
        if attn_metadata is None or attn_metadata.output_rows is None or i != self.num_layers - 1:
            return None
        if not (self.last_stage and getattr(self.layers[i], "takes_output_rows", False)):
            return None
        return None if i < num_additions or self.aux_hidden_state_layers else attn_metadata.output_rows

    # ---- weights -------------------------------------------------------------------------------------------------

    def expected_weight_names(self) -> set[str]:
        """HF checkpoint names (relative to this module) that `load_weights` must receive."""
        names = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names.update(name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            elif ".gate_up_proj." in name:
                names.update(name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj"))
            else:
                names.add(name)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (relative names) into the fused parameters; returns the names consumed.

        Raises ValueError on an unknown name or a shape mismatch. Tensors are converted to the parameter's
        dtype and device. Under tensor parallelism each tensor is this rank's slice (see `checkpoint_shard`).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES) or self.on_other_stage(name):
                continue
            if self._load_kv_scale(name, tensor):
                loaded.add(name)
                continue
            target, piece = self._route(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            module, param = self._owner(target)
            if hasattr(module, "load_shard"):
                module.load_shard(param, piece, tensor, name)
            else:
                copy_weight(params[target], tensor, name)
            loaded.add(name)
        return loaded

    def on_other_stage(self, name: str) -> bool:
        """Whether HF tensor `name` (relative to this module) belongs to a module another pipeline stage holds."""
        head = name.split(".", 1)[0]
        if head == "layers":
            return not self.start_layer <= int(name.split(".")[1]) < self.end_layer
        return isinstance(getattr(self, head, None), AbsentOnStage)

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Set layer i's k_scale / v_scale from `layers.{i}.self_attn.<scale>`; False for other names."""
        suffix = next((s for s in _KV_SCALE_SUFFIXES if name.endswith("." + s)), None)
        if suffix is None or not name.startswith("layers."):
            return False
        layer = int(name.split(".")[1])
        if tensor.numel() != 1:
            raise ValueError(f"{name}: FP8 KV-cache scales must be per tensor, got shape {tuple(tensor.shape)}")
        for attr in _KV_SCALE_SUFFIXES[suffix]:
            setattr(self.layers[layer].self_attn, attr, float(tensor.reshape(())))
        return True

    def checkpoint_shard(self, name: str) -> ShardSpec | None:
        """`(dim, start, length)` of HF tensor `name` (relative to this module) that this tensor-parallel rank
        reads, or None to read it whole (always None with one rank; KV-cache scales are read whole)."""
        if tp_size() == 1 or name.endswith(IGNORED_SUFFIXES) or name.endswith(tuple(_KV_SCALE_SUFFIXES)):
            return None
        target, piece = self._route(name)
        module, param = self._owner(target)
        shard = getattr(module, "checkpoint_shard", None)
        return shard(param, piece) if shard is not None else None

    def _owner(self, target: str) -> tuple[nn.Module, str]:
        """Our parameter name -> (the module holding it, the parameter's name there); (self, name) if none."""
        path, _, param = target.rpartition(".")
        try:
            return (self.get_submodule(path) if path else self), param
        except AttributeError:
            return self, target

    @staticmethod
    def _route(name: str) -> tuple[str, str | None]:
        """HF name -> (our parameter name, the HF projection it fills inside a fused matrix, or None)."""
        for piece, (kind, fused) in _FUSED_PIECES.items():
            if f".{kind}.{piece}." in name:
                return name.replace(piece, fused), piece
        return name, None


def decoder_of(model: nn.Module) -> LlamaDecoderModel:
    """The LlamaDecoderModel inside a causal LM (`.model`) or a VLM (`.language_model`)."""
    for name in ("language_model", "model"):
        dec = getattr(model, name, None)
        if isinstance(dec, LlamaDecoderModel):
            return dec
    raise ValueError(f"{type(model).__name__} has no LlamaDecoderModel (.model or .language_model)")
