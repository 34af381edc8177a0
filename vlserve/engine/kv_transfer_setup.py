"""The engine's part of KV transfer: check the configured connector, and give the offloading connector what both of
its sides must agree on (the host tier's size in blocks, the namespace its stable keys start from)."""

from __future__ import annotations

import copy
import json
import os

import torch

from vlserve.config import ECTransferConfig, EngineArgs, KVTransferConfig, names_eagle
from vlserve.distributed.kv_transfer.factory import check_kv_transfer_config
from vlserve.distributed.kv_transfer.offloading.keys import namespace_key
from vlserve.kernels.kv_quant import kv_cache_torch_dtype
from vlserve.models.hf_config import text_config_of
from vlserve.models.llama import kv_cache_spec


def kv_bytes_per_block(hf_config, block_size: int, kv_dtype: torch.dtype) -> int:
    """KV bytes of one block over all layers and KV heads (the whole model, every rank together)."""
    num_layers, num_kv_heads, head_dim = kv_cache_spec(text_config_of(hf_config))
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=kv_dtype).element_size()


def disk_file_bytes(hf_config, block_size: int, kv_dtype: torch.dtype) -> int:
    """The size of one disk-tier block file (fixed: its header and the `[L, 2, block_size, Hkv, D]` payload)."""
    from vlserve.distributed.kv_transfer.offloading.tier_store import FORMAT, checked_file_bytes

    num_layers, num_kv_heads, head_dim = kv_cache_spec(text_config_of(hf_config))
    return checked_file_bytes(FORMAT, kv_dtype, [num_layers, 2, block_size, num_kv_heads, head_dim])


def disk_tier_blocks(hf_config, block_size: int, kv_dtype: torch.dtype, cap_bytes: int) -> int:
    """How many block files fit the disk tier's cap; ValueError when not even one does."""
    per_file = disk_file_bytes(hf_config, block_size, kv_dtype)
    if cap_bytes < per_file:
        raise ValueError(
            f"kv_offloading_dir_size / disk_bytes_to_use ({cap_bytes} bytes) is less than one block "
            f"file ({per_file} bytes)"
        )
    return cap_bytes // per_file


def checkpoint_parts(loaded) -> tuple[str, str]:
    """The checkpoint's identity: its config (JSON, without its path) and its weight files by name, size and
    mtime."""
    config = loaded.hf_config.to_dict() if hasattr(loaded.hf_config, "to_dict") else {}
    config.pop("_name_or_path", None)
    return json.dumps(config, sort_keys=True, default=str), _weight_files(loaded.model_path)


def _weight_files(path: str) -> str:
    """A checkpoint folder's weight files by name, size and mtime ("" for a path that is not a folder)."""
    files = []
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".safetensors", ".bin", ".pt")):
                st = os.stat(os.path.join(path, name))
                files.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return ",".join(files)


def _eagle_part(args: EngineArgs) -> str:
    """The EAGLE head whose KV layer the offloading tier keeps beside the target's ("" without one)."""
    spec = args.speculative_config
    if not names_eagle(spec):
        return ""
    model = spec.get("model") if isinstance(spec, dict) else getattr(spec, "model", None)
    return f"eagle:{model}:{_weight_files(str(model))}"


def model_namespace(args: EngineArgs, loaded, kv_dtype: torch.dtype) -> bytes:
    """What makes a block's KV differ for the same tokens: the checkpoint (its config, and its weight files by name,
    size and mtime), the KV dtype, the block size, the sharding, and the EAGLE head whose layer the blocks hold."""
    parts = [
        *checkpoint_parts(loaded),
        str(kv_dtype),
        str(args.block_size),
        f"tp{args.tensor_parallel_size}pp{args.pipeline_parallel_size}",
        args.quantization or "",
    ]
    eagle = _eagle_part(args)
    if eagle:  # the tier's blocks then hold the head's layer too (an older namespace stays the same without one)
        parts.append(eagle)
    if args.mm_encoder_quantization:  # media tokens' KV comes from the quantized towers' embeddings
        parts.append(f"mm-encoder:{args.mm_encoder_quantization}")
    return namespace_key(*parts)


def encoder_namespace(args: EngineArgs, loaded) -> bytes:
    """What makes an item's encoder output differ for the same mm_hash: the checkpoint (its config holds the tower's
    and projector's), the model dtype, the model class running the tower, the processor's settings and the
    quantization (the towers' own, `mm_encoder_quantization`, too)."""
    from vlserve.models.registry import get_model_class

    parts = [
        "encoder-outputs",
        *checkpoint_parts(loaded),
        str(loaded.dtype),
        get_model_class(loaded.hf_config).__name__,
        json.dumps(args.mm_processor_kwargs or {}, sort_keys=True, default=str),
        args.quantization or "",
    ]
    if args.mm_encoder_quantization:  # (a namespace without it stays the same)
        parts.append(f"mm-encoder:{args.mm_encoder_quantization}")
    return namespace_key(*parts)


def resolve_ec_transfer(args: EngineArgs, loaded) -> EngineArgs:
    """`args` unchanged without an encoder-cache connector; else a copy whose ec_transfer_config carries the
    namespace its files live under. ValueError for what it does not support."""
    cfg = args.ec_transfer_config
    if cfg is None:
        return args
    if args.world_size > 1 or args.distributed_executor_backend not in (None, "uni"):
        raise ValueError(
            "ec_transfer_config runs with one rank in the engine's process for now "
            "(tensor_parallel_size = pipeline_parallel_size = 1, no distributed executor)"
        )
    if not loaded.modalities:
        raise ValueError(f"ec_transfer_config needs a multimodal model; {loaded.model_path} has no encoder")
    extra = {**cfg.ec_connector_extra_config, "_namespace": encoder_namespace(args, loaded).hex()}
    args = copy.copy(args)
    args.ec_transfer_config = ECTransferConfig(cfg.ec_connector, cfg.ec_role, extra)
    return args


def check_kv_transfer(args: EngineArgs) -> None:
    """ValueError for an unknown connector, and for what the connectors do not support yet."""
    cfg = args.kv_transfer_config
    if cfg is None:
        return
    check_kv_transfer_config(cfg)
    if args.world_size > 1 or args.distributed_executor_backend not in (None, "uni"):
        raise ValueError(
            "KV connectors run with one rank in the engine's process for now "
            "(tensor_parallel_size = pipeline_parallel_size = 1, no distributed executor)"
        )


def resolve_kv_transfer(args: EngineArgs, loaded) -> EngineArgs:
    """`args` unchanged without a connector; else a copy whose kv_transfer_config carries the engine-filled keys."""
    cfg = args.kv_transfer_config
    if cfg is None:
        return args
    check_kv_transfer(args)
    extra = dict(cfg.kv_connector_extra_config)
    if cfg.kv_connector == "OffloadingConnector":
        kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, loaded.dtype, loaded.device)
        per_block = kv_bytes_per_block(loaded.hf_config, args.block_size, kv_dtype)
        if _eagle_part(args):  # the head's layer, about one more of the target's
            per_block += per_block // kv_cache_spec(text_config_of(loaded.hf_config))[0]
        extra["_num_cpu_blocks"] = int(extra.get("cpu_bytes_to_use", 0)) // per_block
        if extra.get("disk_bytes_to_use") is not None:
            extra["_disk_max_blocks"] = disk_tier_blocks(
                loaded.hf_config, args.block_size, kv_dtype, int(extra["disk_bytes_to_use"])
            )
        extra["_namespace"] = model_namespace(args, loaded, kv_dtype).hex()
    elif cfg.kv_connector == "P2PConnector":
        import uuid

        from vlserve.distributed.kv_transfer.p2p.side_channel import free_port

        extra.setdefault("_engine_id", uuid.uuid4().hex)
        if cfg.is_producer and "side_channel_port" not in extra:  # the scheduler and the worker agree on it here
            extra["_side_channel_port"] = free_port(extra.get("side_channel_host", "127.0.0.1"))
    args = copy.copy(args)
    args.kv_transfer_config = KVTransferConfig(cfg.kv_connector, cfg.kv_role, extra)
    return args
