"""Elementwise activations by the names HF configs use (`hidden_act`), our own table instead of transformers'."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vlserve.kernels.quick_gelu_cpu import quick_gelu

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,  # one C++ pass on CPU (kernels.quick_gelu_cpu)
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function a config's `hidden_act` names; ValueError naming it and the supported ones otherwise."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {str(name)[:40]!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
