"""Model implementations, the architecture registry and the safetensors loader."""

from vlserve.models.llama import kv_cache_spec
from vlserve.models.loader import iter_safetensors_weights, load_model
from vlserve.models.registry import get_model_class, register_model, supported_architectures

__all__ = [
    "get_model_class",
    "iter_safetensors_weights",
    "kv_cache_spec",
    "load_model",
    "register_model",
    "supported_architectures",
]
