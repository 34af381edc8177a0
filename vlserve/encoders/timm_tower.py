"""A vision tower that timm builds: `timm.create_model(architecture, pretrained=False, num_classes=0, **model_args)`,
exactly as transformers' TimmWrapper creates it, with the checkpoint's weights loaded into it by timm's own names.

Any backbone the wrapper accepts serves without new tower code. The tower runs timm's modules and attention
(`F.scaled_dot_product_attention` inside timm), not vlserve.kernels. Features are what the wrapper returns as
`last_hidden_state`: `forward_features` (tokens after the final norm, prefix tokens such as CLS included).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlserve.kernels.packed_linear import packable


def timm_tower_args(vision_config) -> tuple[str, dict]:
    """(architecture, model_args) of a TimmWrapperConfig (or any object / dict with those fields); ValueError
    for settings the wrapper would not turn into token features."""
    get = vision_config.get if isinstance(vision_config, dict) else lambda k, d=None: getattr(vision_config, k, d)
    architecture = get("architecture")
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"vision_config.architecture must name a timm model, got {architecture!r}")
    model_args = dict(get("model_args") or {})
    if model_args.get("features_only"):
        raise ValueError(
            "vision_config.model_args.features_only=True gives feature maps, not the token features a "
            "multimodal projector takes; it is not supported"
        )
    model_args.pop("num_classes", None)  # the wrapper always builds the backbone without a classifier
    return architecture, model_args


class TimmVisionTower(nn.Module):
    """`timm_model` built by timm; `forward(pixels [N, C, S, S]) -> [N, L, D]` (L includes prefix tokens).

    Built under `torch.device("meta")` by the loader like every vlserve model: `init_buffers(device)` then recomputes
    timm's non-persistent buffers (RoPE tables and the like), which no checkpoint carries.
    """

    def __init__(self, architecture: str, model_args: dict | None = None) -> None:
        super().__init__()
        import timm

        self.architecture = architecture
        self.model_args = dict(model_args or {})
        try:
            self.timm_model = packable(
                timm.create_model(architecture, pretrained=False, num_classes=0, **self.model_args)
            )
        except RuntimeError as e:
            if "Unknown model" in str(e):
                raise ValueError(
                    f"timm {timm.__version__} has no architecture {architecture!r} (vision_config.architecture)"
                ) from None
            raise
        self.num_features = int(self.timm_model.num_features)  # D, the width of forward_features' tokens
        self.num_prefix_tokens = int(getattr(self.timm_model, "num_prefix_tokens", 0))

    @classmethod
    def from_config(cls, vision_config) -> TimmVisionTower:
        """Build from a TimmWrapperConfig (architecture + model_args)."""
        return cls(*timm_tower_args(vision_config))

    # ---- buffers -------------------------------------------------------------------------------------------------

    def _non_persistent_buffers(self) -> list[str]:
        persistent = set(self.timm_model.state_dict())
        return [n for n, _ in self.timm_model.named_buffers() if n not in persistent]

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent buffers after `to_empty`: timm's `init_non_persistent_buffers()` where a
        module has one; any other such buffer is copied from a reference model built on the CPU."""
        covered: set[str] = set()
        for name, module in self.timm_model.named_modules():
            if hasattr(module, "init_non_persistent_buffers"):
                module.init_non_persistent_buffers()
                prefix = f"{name}." if name else ""
                covered.update(prefix + b for b, _ in module.named_buffers())
        rest = [n for n in self._non_persistent_buffers() if n not in covered]
        if not rest:
            return
        import timm

        with torch.device("cpu"):
            ref = dict(
                timm.create_model(self.architecture, pretrained=False, num_classes=0, **self.model_args).named_buffers()
            )
        own = dict(self.timm_model.named_buffers())
        for n in rest:
            own[n].copy_(ref[n].to(dtype=own[n].dtype))

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`pixel_values [N, C, S, S]` -> token features `[N, L, D]`, what TimmWrapperModel returns as
        last_hidden_state (prefix tokens first)."""
        param = next(self.timm_model.parameters())
        return self.timm_model.forward_features(pixel_values.to(device=param.device, dtype=param.dtype))

    # ---- weights -------------------------------------------------------------------------------------------------

    def expected_weight_names(self) -> set[str]:
        """timm's state-dict names (parameters and persistent buffers), relative to `timm_model`."""
        return set(self.timm_model.state_dict())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy `(timm name, tensor)` pairs into the model; returns the names loaded. ValueError for an unknown
        name or a shape mismatch."""
        targets = dict(self.timm_model.named_parameters())
        targets.update(self.timm_model.named_buffers())
        expected = self.expected_weight_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in expected:
                raise ValueError(f"unexpected vision tower weight {name!r} for timm {self.architecture!r}")
            dst = targets[name]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"vision tower weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(name)
        return loaded
