"""Build a registered model and fill it from a HF safetensors checkpoint (single file or sharded index)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from vlserve.distributed.parallel_state import pp_size, tp_size
from vlserve.models.capabilities import model_capabilities
from vlserve.models.llama import decoder_of
from vlserve.models.quantization import apply_quantization, get_quantization_config, process_quantized_weights
from vlserve.models.quantization.encoder_int8 import quantize_encoder_linears
from vlserve.models.registry import get_model_class
from vlserve.models.tower_sharding import shard_tower_blocks

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype, hf_config=None) -> torch.dtype:
    """torch.dtype from a dtype or a name ("float32", "bf16", "auto" = the config's dtype, float32 if unset)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name == "auto":
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        return resolve_dtype(cfg, None) if cfg not in (None, "auto") else torch.float32
    aliases = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
    name = aliases.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16")
    return getattr(torch, name)


def safetensors_files(model_dir: str) -> list[str]:
    """Paths of the checkpoint's safetensors files; FileNotFoundError names what is missing."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    single = os.path.join(model_dir, SINGLE_FILE)
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = [os.path.join(model_dir, s) for s in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"checkpoint shard(s) listed in {index} not found: {', '.join(missing)}")
        return files
    raise FileNotFoundError(
        f"no safetensors weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}"
        + (
            " (only PyTorch .bin weights are present, which are not supported)"
            if any(n.endswith(".bin") for n in os.listdir(model_dir))
            else ""
        )
    )


ShardFn = Callable[[str], "tuple[int, int, int] | None"]


def iter_safetensors_weights(
    model_dir: str, shard_of: ShardFn | None = None, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(HF name, CPU tensor)` for every tensor of the checkpoint in `model_dir`.

    With `shard_of` (a model's `checkpoint_shard`), a name it maps to `(dim, start, length)` yields only that slice,
    read from the file through `get_slice` (the rest of the tensor is never read); None yields the whole tensor.
    Names `skip` is true for (another pipeline stage's tensors) are neither read nor yielded.
    """
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                try:
                    shard = shard_of(name) if shard_of is not None else None
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = shard
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, f.get_slice(name)[index]


def checkpoint_tensor_names(model_dir: str) -> list[str]:
    """Every tensor name of the checkpoint (read from the safetensors headers only)."""
    from safetensors import safe_open

    names: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def decoder_prefix(names: list[str]) -> str:
    """The checkpoint prefix of the language decoder's tensors (`model.`, `model.language_model.`,
    `language_model.model.`): where its `embed_tokens.weight` lies."""
    found = sorted(n[: -len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight"))
    if len(found) != 1:
        raise ValueError(
            f"cannot tell the language decoder's tensors apart in this checkpoint ({len(found)} "
            "embed_tokens.weight tensors)"
        )
    return found[0]


def meta_model(hf_config) -> nn.Module:
    """The registered class for `hf_config` built on the meta device, without any weight memory (building it checks
    the config as loading would)."""
    with torch.device("meta"):
        return get_model_class(hf_config)(hf_config)


def load_model(
    model_dir: str,
    hf_config,
    dtype,
    device,
    quantization: str | None = None,
    encoder_only: bool = False,
    mm_encoder_quantization: str | None = None,
    shard_towers: bool = False,
) -> nn.Module:
    """Instantiate the registered class for `hf_config` in `dtype` on `device` and load its weights (eval mode).

    The module is built on the meta device (no random init), materialized with `to_empty`, then every module
    with an `init_buffers(device)` method recomputes its non-persistent buffers (RoPE tables), `tie_weights()`
    re-ties lm_head, and `model.load_weights(iter_safetensors_weights(model_dir))` fills all parameters.

    Under tensor parallelism (`vlserve.distributed.init_tensor_parallel` called first) the model is built with this
    rank's shard sizes and each rank reads only its slices of the sharded tensors (`model.checkpoint_shard`). A
    pipeline stage builds its own layers and reads only their tensors (`model.on_other_stage`); a VLM's encoder parts
    are dropped off its later stages (`model.keep_stage_parts`).

    `encoder_only` (an encode server): a multimodal model keeps its encoder parts and token embeddings only
    (`keep_encoder_parts`); the decoder layers' and lm_head's tensors are never read. ValueError for a model with
    no encoder.

    A quantized checkpoint (`quantization_config` in its config; `quantization` may name the method and must
    match) gets its decoder's linear layers swapped for the format's tensors before loading and turned into the
    kernels' form after (`models.quantization`). `mm_encoder_quantization` ("int8") quantizes the float linears of
    the encoder parts once loaded (`models.quantization.encoder_int8`). `shard_towers` (under tensor parallelism,
    `mm_encoder_tp_mode="weights"`) splits the Qwen-family vision towers' blocks over the ranks once loaded
    (`models.tower_sharding`; other towers stay whole).
    """
    cls = get_model_class(hf_config)
    caps = model_capabilities(cls, hf_config)
    if encoder_only and not caps.mm_encoder_only:
        raise ValueError(f"mm_encoder_only needs a multimodal model; {cls.__name__} has no media encoder")
    dtype = resolve_dtype(dtype, hf_config)
    device = torch.device(device)
    safetensors_files(model_dir)  # fail fast, before building anything
    qconfig = get_quantization_config(hf_config, quantization)
    if encoder_only and qconfig is not None:
        raise ValueError(
            "mm_encoder_only does not load quantized checkpoints yet (their quantization is the "
            "decoder's, which an encode server does not hold)"
        )
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config)
            if pp_size() > 1:
                model.keep_stage_parts()  # a VLM's later stages hold no encoder parts
            if encoder_only:
                model.keep_encoder_parts()  # an encode server holds no decoder layers nor lm_head
    finally:
        torch.set_default_dtype(prev)
    if qconfig is not None:
        names = checkpoint_tensor_names(model_dir)
        apply_quantization(decoder_of(model), decoder_prefix(names), qconfig, names)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
    model.tie_weights()
    shard_of = None
    if tp_size() > 1:
        if not caps.tensor_parallel:
            raise ValueError(f"{cls.__name__} does not support tensor_parallel_size > 1")
        shard_of = model.checkpoint_shard
    try:
        # pipeline stages and encode servers read only their own tensors
        skip = model.on_other_stage if pp_size() > 1 or encoder_only else None
        model.load_weights(iter_safetensors_weights(model_dir, shard_of, skip))
    except ValueError as e:
        raise ValueError(f"{e} (checkpoint {model_dir})") from e
    if qconfig is not None:
        process_quantized_weights(model)
    if shard_towers and hasattr(model, "encoder_parts"):
        shard_tower_blocks(model.encoder_parts())
    if mm_encoder_quantization is not None:
        quantize_encoder_linears(model, mm_encoder_quantization)
    return model.eval()
