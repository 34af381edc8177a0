"""Dual-tower (contrastive) embedders: CLIP (`CLIPModel`) and SigLIP (`SiglipModel`) checkpoints as HF writes them.
A text tower and an image tower map into one space; each request embeds either a text or an image.

    embed_text(input_ids [B, T] int64, attention_mask [B, T] | None) -> [B, D] float32
    embed_image(pixel_values [N, 3, S, S]) -> [N, D] float32
    similarity(text_embeds [B, D], image_embeds [N, D]) -> logits_per_text [B, N] float32

`embed_text` / `embed_image` return the unnormalized projections (HF's `get_text_features` / `get_image_features`);
`similarity` normalizes them and scales by `logit_scale.exp()` (plus `logit_bias` for SigLIP), as HF's forward
computes `logits_per_text` (`logits_per_image` is its transpose). Inputs come from the families' own processors:
CLIP's tokenizer pads on the right and ends each text with its EOS token; SigLIP's texts must be padded to
`max_length=text_config.max_position_embeddings` (`padding="max_length"`, as SigLIP was trained): its `head` pools
the last position, padding included, so the padded length changes the embedding.

These classes generate nothing: their capabilities say `pooling=True, kv_free=True, dual_tower=True` and
`modalities=("image",)`, and the engine serves them with the KV-free pooling runner (vlserve.worker.kv_free_runner),
never the generation path (`forward` / `compute_logits` raise). Its two calls:

    pool_prompts(token_ids: list of [T_i] int64, spec) -> [N, D] float32   (whole text prompts)
    embed_multimodal("image", {"pixel_values": [N, 3, S, S]}) -> [N, D] float32   (one embedding per image)

They load through `vlserve.models.load_model` like every registered model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.encoders.clip_vision import VitConfig
from vlserve.encoders.pooled_vision import ClipPooledVisionTower, SiglipPooledVisionTower
from vlserve.encoders.text_tower import ContrastiveTextTower, TextTowerConfig
from vlserve.encoders.vision_layers import VisionMLP, fold_quick_gelu_mlps
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import ModelCapabilities
from vlserve.pooling_params import PoolerSpec

DUAL_TOWER_CAPABILITIES = ModelCapabilities(modalities=("image",), pooling=True, kv_free=True, dual_tower=True)


class DualTowerEmbedder(nn.Module):
    """What CLIP and SigLIP share: the two towers (`text_model`, `vision_model`), the scoring parameters, weight
    loading by HF name, and the embedding calls (the families differ in how they pool and project)."""

    capabilities = DUAL_TOWER_CAPABILITIES
    text_model: ContrastiveTextTower
    vision_model: ClipPooledVisionTower
    _top_level_names: tuple[str, ...] = ()  # checkpoint names outside the two towers
    pads_text_batches: bool = False  # whether texts of different lengths may share a batch (right-padded)

    @classmethod
    def capabilities_for(cls, hf_config) -> ModelCapabilities:
        """`capabilities` as stated (no value depends on the config)."""
        return cls.capabilities

    def _encode_text(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Checked `input_ids [B, T]`, `mask [B, T]` on the tower's device -> the family's text embeddings `[B, D]`."""
        raise NotImplementedError

    def _project_image(self, pooled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def projection_dim(self) -> int:
        """D: the width of both towers' embeddings."""
        raise NotImplementedError

    @torch.no_grad()
    def embed_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`input_ids [B, T]` (padded as the family's tokenizer pads), `attention_mask [B, T]` or None -> the text
        embeddings `[B, D]` float32, unnormalized (HF's `get_text_features`). ValueError on malformed input."""
        mask = self.text_model.check_inputs(input_ids, attention_mask)
        if not bool(mask.any(dim=1).all()):
            raise ValueError("every text needs at least one token (a row of attention_mask is all zeros)")
        device = self.text_model.embeddings.token_embedding.weight.device
        return self._encode_text(input_ids.to(device), mask.to(device)).float()

    @torch.no_grad()
    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`pixel_values [N, 3, S, S]` (the family's image processor's output) -> the image embeddings `[N, D]`
        float32, unnormalized (HF's `get_image_features`). ValueError on a wrong shape."""
        dtype = self.vision_model.post_layernorm.weight.dtype
        pooled = self.vision_model.pooled(pixel_values.to(dtype))  # [N, E]
        return self._project_image(pooled).float()

    @torch.no_grad()
    def pool_prompts(self, token_ids: list[torch.Tensor], spec: PoolerSpec | None = None) -> torch.Tensor:
        """Whole text prompts (each `[T_i]` int64, as the family's tokenizer makes them) -> their embeddings `[N, D]`
        float32, unnormalized (the kv_free pooling call; the family pools, `spec` changes nothing). Prompts of one
        length run as one batch; `pads_text_batches` families (CLIP) also batch different lengths, padded on the
        right under a mask (the tower computes the unpadded tokens only)."""
        if not token_ids:
            raise ValueError("pool_prompts needs at least one prompt")
        device = self.text_model.embeddings.token_embedding.weight.device
        groups: dict[int, list[int]] = {}  # length (0: all, padded) -> prompt indices
        for i, ids in enumerate(token_ids):
            if ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"each prompt must be a non-empty [T] tensor, got {tuple(ids.shape)}")
            groups.setdefault(0 if self.pads_text_batches else ids.numel(), []).append(i)
        out = torch.empty(len(token_ids), self.projection_dim, dtype=torch.float32, device=device)
        for indices in groups.values():
            rows = [token_ids[i].to(device=device, dtype=torch.long) for i in indices]
            ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, T], 0 past each prompt
            lengths = torch.tensor([r.numel() for r in rows], device=device)  # [B]
            mask = (torch.arange(ids.shape[1], device=device)[None, :] < lengths[:, None]).long()  # [B, T]
            out[indices] = self.embed_text(ids, mask)  # [B, D]
        return out

    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """The encoder path's call: images (`data["pixel_values"] [N, 3, S, S]`) -> `[N, D]` float32, one
        embedding per image (`embed_image`); ValueError for any other modality."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} embeds texts and images, not {modality}")
        return self.embed_image(data["pixel_values"])

    @classmethod
    def text_padding_length(cls, hf_config) -> int | None:
        """The length the family's tokenizer pads each text to (None: no padding)."""
        return None

    @classmethod
    def check_text_ids(cls, hf_config, token_ids: list[int]) -> None:
        """ValueError when a text prompt's ids are not what this family embeds (the front end's check)."""
        limit, vocab = hf_config.text_config.max_position_embeddings, hf_config.text_config.vocab_size
        if not token_ids or len(token_ids) > limit:
            raise ValueError(f"a text prompt must have 1 to {limit} tokens, got {len(token_ids)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")

    @torch.no_grad()
    def similarity(self, text_embeds: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        """`text_embeds [B, D]`, `image_embeds [N, D]` (from embed_text / embed_image) -> `logits_per_text [B, N]`
        float32: cosine similarity times `logit_scale.exp()`, plus `logit_bias` where the family has one."""
        if text_embeds.dim() != 2 or image_embeds.dim() != 2 or text_embeds.shape[1] != image_embeds.shape[1]:
            raise ValueError(
                f"similarity needs [B, D] and [N, D] embeddings, got {tuple(text_embeds.shape)} and "
                f"{tuple(image_embeds.shape)}"
            )
        text = F.normalize(text_embeds.float(), dim=-1)
        image = F.normalize(image_embeds.float().to(text.device), dim=-1)
        logits = text @ image.T * self.logit_scale.float().exp()
        bias = getattr(self, "logit_bias", None)
        return logits if bias is None else logits + bias.float()

    def forward(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a dual-tower embedder: call embed_text / embed_image")

    def compute_logits(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a dual-tower embedder and has no language-model head")

    def tie_weights(self) -> None:
        """Nothing is tied."""

    def encoder_parts(self) -> list[nn.Module]:
        """Both towers: they take many rows a call (`pack_linears_for_cpu(model, many_rows=model.encoder_parts())`
        packs them as the runner packs a VLM's towers)."""
        return [self.text_model, self.vision_model]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from HF-named tensors (`text_model.*`, `vision_model.*` and the top-level
        projections / scales); ValueError on an unknown name, a shape mismatch, or a parameter left unfilled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("text_model."):
                loaded |= {"text_model." + n for n in self.text_model.load_weights([(name, tensor)])}
            elif name.startswith("vision_model."):
                loaded |= {"vision_model." + n for n in self.vision_model.load_weights([(name, tensor)])}
            elif name in self._top_level_names:
                target = params[name]
                if target.numel() != tensor.numel():
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
                target.data.copy_(tensor.reshape(target.shape))
                loaded.add(name)
            else:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
        expected = {
            f"{part}.{n}"
            for part in ("text_model", "vision_model")
            for n in getattr(self, part).expected_weight_names()
        }
        expected |= {n for n in params if not n.startswith(("text_model.", "vision_model."))}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing[:8])}")
        for mlp in self.modules():  # quick-GELU runs inside fc1's matmul from here on (no tower LoRA here)
            if isinstance(mlp, VisionMLP):
                mlp.quick_gelu_folded = False  # the weights just loaded are the checkpoint's
        fold_quick_gelu_mlps(self)


class CLIPDualTower(DualTowerEmbedder):
    """CLIP: a causal text tower pooled at its EOS token then `text_projection`; the vision tower's class token after
    post_layernorm then `visual_projection`; `logit_scale` (log of the temperature's inverse), no bias."""

    capabilities = DUAL_TOWER_CAPABILITIES
    _top_level_names = ("text_projection.weight", "visual_projection.weight", "logit_scale")
    pads_text_batches = True  # causal, pooled at the EOS token: right padding under a mask changes nothing

    @classmethod
    def check_text_ids(cls, hf_config, token_ids: list[int]) -> None:
        """As the base's, and the ids must hold the EOS token CLIP pools at (unless the config has the legacy
        eos_token_id 2, pooled at the largest id)."""
        super().check_text_ids(hf_config, token_ids)
        eos = hf_config.text_config.eos_token_id
        if eos != 2 and eos not in token_ids:
            raise ValueError(f"a CLIP text prompt must contain the EOS token {eos} (the tokenizer adds it)")

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text_cfg = TextTowerConfig.from_hf(config.text_config, causal=True)
        vision_cfg = VitConfig.from_hf(config.vision_config)
        self.eos_token_id = config.text_config.eos_token_id
        self.text_model = ContrastiveTextTower(text_cfg)
        self.vision_model = ClipPooledVisionTower(vision_cfg)
        self.text_projection = PackableLinear(text_cfg.width, config.projection_dim, bias=False)
        self.visual_projection = PackableLinear(vision_cfg.width, config.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.zeros(()))

    @property
    def projection_dim(self) -> int:
        return self.text_projection.out_features

    def eos_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [B, T]` -> the pooled position of each row `[B]`, HF's rule: the first `eos_token_id`; for
        configs whose eos_token_id is the legacy 2, the position of the largest id (the EOT token has the highest
        id in the original vocabulary)."""
        ids = input_ids.to(torch.int32)
        if self.eos_token_id == 2:
            return ids.argmax(dim=-1)
        return (ids == self.eos_token_id).int().argmax(dim=-1)

    def _encode_text(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # input_ids, mask: [B, T] -> [B, D]; the tower computes the unpadded tokens only (causal: padding after a
        # token changes nothing before it)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        positions = self.eos_positions(input_ids)  # [B]
        if self.eos_token_id != 2 and not bool((input_ids[rows, positions] == self.eos_token_id).all()):
            raise ValueError(f"every CLIP text must contain the EOS token {self.eos_token_id} (the tokenizer adds it)")
        if not bool(mask[rows, positions].bool().all()):
            raise ValueError("the EOS token CLIP pools at is padding (pad on the right, as CLIP's tokenizer does)")
        unpadded_index = (mask.flatten().cumsum(0) - 1).view_as(mask)  # [B, T]: each token's row of the R unpadded
        pooled = unpadded_index[rows, positions].long()  # [B], increasing
        return self.text_projection(self.text_model.forward_unpadded(input_ids, mask, pooled))  # [B, E] -> [B, D]

    def _project_image(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.visual_projection(pooled)


class SiglipDualTower(DualTowerEmbedder):
    """SigLIP: a bidirectional text tower pooled at its last position through `text_model.head`; the vision tower's
    attention-pooling head (the image embedding, no further projection); `logit_scale` and `logit_bias`."""

    capabilities = DUAL_TOWER_CAPABILITIES
    _top_level_names = ("logit_scale", "logit_bias")
    pads_text_batches = False  # pools the last position: a padded batch would pool padding

    @classmethod
    def text_padding_length(cls, hf_config) -> int | None:
        """`max_position_embeddings`: texts are padded to it (`padding="max_length"`, as SigLIP was trained)."""
        return hf_config.text_config.max_position_embeddings

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        if not getattr(config.vision_config, "vision_use_head", True):
            raise ValueError("a SigLIP embedder needs its vision pooling head (vision_config.vision_use_head)")
        text = config.text_config
        head_out = getattr(text, "projection_size", None) or text.hidden_size
        vision_cfg = VitConfig.from_hf(config.vision_config)
        if head_out != vision_cfg.width:
            raise ValueError(
                f"SigLIP text embeddings ({head_out}) and image embeddings ({vision_cfg.width}) differ in width"
            )
        self.text_model = ContrastiveTextTower(TextTowerConfig.from_hf(text, causal=False, head_out=head_out))
        self.vision_model = SiglipPooledVisionTower(vision_cfg)
        self.logit_scale = nn.Parameter(torch.zeros(1))
        self.logit_bias = nn.Parameter(torch.zeros(1))

    @property
    def projection_dim(self) -> int:
        return self.text_model.head.out_features

    def _encode_text(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # input_ids, mask: [B, T] -> [B, D]; every position is computed: the last one is pooled, padding or not
        hidden = self.text_model(input_ids, mask)  # [B, T, E]
        return self.text_model.head(hidden[:, -1])

    def _project_image(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled
