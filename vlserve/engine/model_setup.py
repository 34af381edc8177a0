"""Load everything a checkpoint directory provides: config, weights, tokenizer, HF processor, EOS ids."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlserve.config import EngineArgs
from vlserve.engine.mm_setup import load_multimodal, video_limits_from_args
from vlserve.engine.pooling import sentence_transformers_max_seq_length
from vlserve.models.hf_config import text_config_of, token_id_of
from vlserve.multimodal.processor import wants_fast_processor

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint ready to serve (tensors live in `model`; the rest is plain configuration). Built once, whole,
    by `load_for_serving`."""

    model_path: str
    hf_config: Any
    model: torch.nn.Module
    tokenizer: Any
    processor: Any  # the HF AutoProcessor for multimodal checkpoints, else None
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    mrope_positions_fn: Callable | None = None
    modalities: tuple[str, ...] = field(default=())
    mm_processor: Any = None  # vlserve.multimodal.processor.MultiModalProcessor for multimodal checkpoints

    @property
    def is_multimodal(self) -> bool:
        return bool(self.modalities)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _eos_token_ids(model_path: str, hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    gen_path = os.path.join(model_path, "generation_config.json")
    sources = []
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    sources.append(token_id_of(hf_config, "eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        for tid in src if isinstance(src, list) else [src]:
            if isinstance(tid, int) and tid not in ids:
                ids.append(tid)
    return tuple(ids)


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    from transformers import AutoTokenizer

    path = tokenizer_path or model_path
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files in {path!r} (expected one of {', '.join(_TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(path)


def check_pipeline_stages(model_cls, hf_config, num_stages: int) -> None:
    """ValueError unless `model_cls` splits over pipeline stages and its layers over `num_stages` (the partition
    $VLSERVE_PP_LAYER_PARTITION asks for, or an even one)."""
    from vlserve.distributed.pipeline import layer_partition
    from vlserve.models.capabilities import stated_capabilities

    stated = stated_capabilities(model_cls)  # whether a class splits over stages does not depend on the checkpoint
    if not stated.pipeline_parallel:
        why = stated.pipeline_parallel_refusal
        raise ValueError(
            f"{model_cls.__name__} does not support pipeline_parallel_size > 1 yet"
            + (f": {why}" if why else "")
            + " (the Llama, Mistral, Qwen2 and Qwen3 causal LMs, "
            "Qwen2-VL, Qwen2.5-VL, LLaVA and LLaVA-NeXT do)"
        )
    layer_partition(text_config_of(hf_config).num_hidden_layers, num_stages)


def load_for_serving(
    model_path: str, args: EngineArgs, build_model: bool = True, processor: bool = True
) -> LoadedModel:
    """Read the checkpoint at model_path and build the model on the chosen device and dtype. Without
    `build_model` (the ranks load their own shards elsewhere) no weight is read: `model` is None, and the config is
    checked by building the model on the meta device, which holds no memory. Without
    `processor` (an engine process: its requests arrive processed) no HF processor is loaded, nor transformers'
    image-processing modules (torchvision, scipy: about 70 MiB of the process)."""
    from transformers import AutoConfig

    from vlserve.models.capabilities import model_capabilities
    from vlserve.models.loader import load_model, meta_model, resolve_dtype
    from vlserve.models.quantization import get_quantization_config
    from vlserve.models.registry import get_model_class

    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read config.json in {model_path!r}: {e}") from e
    model_cls = get_model_class(hf_config)  # unsupported architecture -> ValueError before any heavy work
    caps = model_capabilities(model_cls, hf_config)
    if caps.kv_free and args.runner == "generate":
        what = "a dual-tower embedder" if caps.dual_tower else "a pooling model"
        raise ValueError(
            f"{model_path} ({model_cls.__name__}) is {what} with no decoder to generate with: serve it with "
            "runner='pooling' (--runner pooling), or leave runner at 'auto'"
        )
    if args.mm_encoder_only and not model_capabilities(model_cls, hf_config).mm_encoder_only:
        raise ValueError(
            f"mm_encoder_only needs a multimodal model; {model_path} ({model_cls.__name__}) has no media encoder"
        )
    if args.mm_encoder_quantization and not model_capabilities(model_cls, hf_config).modalities:
        raise ValueError(
            f"mm_encoder_quantization needs a multimodal model; {model_path} ({model_cls.__name__}) has no media encoder"
        )
    if args.pipeline_parallel_size > 1:
        check_pipeline_stages(model_cls, hf_config, args.pipeline_parallel_size)
    get_quantization_config(hf_config, args.quantization)  # an unsupported or mismatched quantization, too
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, hf_config)
    tokenizer = load_tokenizer(model_path, args.tokenizer)
    text_cfg = text_config_of(hf_config)
    model_max = getattr(text_cfg, "max_position_embeddings", None) or 2048
    limit = f"the model's max_position_embeddings={model_max}"
    st_max = sentence_transformers_max_seq_length(model_path, tokenizer)
    if st_max is not None and st_max < model_max:
        model_max, limit = st_max, f"the sentence-transformers max_seq_length={st_max}"
    max_model_len = args.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds {limit}")
    torch.manual_seed(args.seed)
    if build_model:
        model = facts = load_model(
            model_path,
            hf_config,
            dtype,
            device,
            args.quantization,
            encoder_only=args.mm_encoder_only,
            mm_encoder_quantization=args.mm_encoder_quantization,
        )
    else:
        model, facts = None, meta_model(hf_config)
    mm = load_multimodal(
        model_path,
        hf_config,
        facts,
        max_audio_seconds=args.max_audio_seconds,
        use_fast=wants_fast_processor(args.mm_processor_kwargs),
        processor=processor,
        video_limits=video_limits_from_args(args),
    )
    return LoadedModel(
        model_path,
        hf_config,
        model,
        tokenizer,
        mm.processor,
        device,
        dtype,
        max_model_len,
        _eos_token_ids(model_path, hf_config, tokenizer),
        mrope_positions_fn=mm.mrope_positions_fn,
        modalities=mm.modalities,
        mm_processor=mm.mm_processor,
    )
