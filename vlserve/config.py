"""Engine configuration: the user's knobs (EngineArgs) resolved against the checkpoint (VlserveConfig)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vlserve.pooling_params import PoolerConfig, apply_hf_overrides, check_runner_args
from vlserve.reasoning import get_reasoning_parser
from vlserve.shorten import shorten
from vlserve.structured_output.params import StructuredOutputsConfig
from vlserve.transfer_config import ECTransferConfig, KVTransferConfig  # noqa: F401 - re-exported (vlserve.config)


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets the scheduler enforces every step."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 8192  # in embeddings
    encoder_compute_budget: int = 8192  # embeddings encoded per step (a step's first item is always admitted)
    num_spec_tokens: int = 0
    max_waiting_requests: int | None = None
    # never end a step inside a media item's placeholder run (models whose image tokens attend both ways: Gemma 3)
    disable_chunked_mm_input: bool = False
    # the sliding window of each KV cache group (core/kv_cache_groups.py; None: full attention)
    kv_group_windows: tuple[int | None, ...] = (None,)
    max_loras: int = 0  # distinct LoRA adapters in one step (0: LoRA off, adapter requests are refused)
    kv_transfer_config: KVTransferConfig | None = None  # the KV connector (distributed/kv_transfer), None: off
    # per modality, the stages an item's tower may be split into across steps (absent: one piece); the model's
    # `encoder_stage_counts`
    encoder_stage_counts: dict[str, int] = field(default_factory=dict)
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (core/request_queue.py)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "encoder_compute_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.scheduling_policy == "priority" and self.kv_transfer_config is not None:
            raise ValueError("scheduling_policy='priority' does not work with a KV connector yet; use 'fcfs'")


MM_ENCODER_TP_MODES = ("weights", "data")  # towers over TP ranks: models/tower_sharding.py, worker/encoder_split.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model dtype; fp8 / fp8_e4m3: float8_e4m3fn (vLLM's names)
DEFAULT_CAPTURE_SIZES_HEAD = (1, 2, 4, 8)  # then every multiple of 8 up to max_num_seqs
COMPILE_CACHE_ENV = "VLSERVE_COMPILE_CACHE_DIR"


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's CUDA-graph batch sizes: 1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (which is always included)."""
    sizes = [n for n in DEFAULT_CAPTURE_SIZES_HEAD if n <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def default_compile_cache_dir() -> str:
    """Where compiled artifacts live: $VLSERVE_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache)/vlserve/compile."""
    if os.environ.get(COMPILE_CACHE_ENV):
        return os.environ[COMPILE_CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vlserve", "compile")


# On CPU the compiled wrapper runs in Python every step: its per-op size/stride and alignment asserts (about 80 calls a
# step at 8 layers) are host time the kernels wait for, and the shapes they check are fixed by the graph.
CPU_INDUCTOR_DEFAULTS = {"freezing": True, "size_asserts": False, "alignment_asserts": False}
DEFAULT_LEVEL_ENV = "VLSERVE_DEFAULT_COMPILE_LEVEL"  # 0..3: the level of configs that leave it unset (tests: 0)


@dataclass
class CompilationConfig:
    """How the decoder forward runs (vLLM's -O levels). `level`: 0 eager; 1 torch.compile (inductor, dynamic token
    dimension, attention kept opaque); 2 = 1 plus CUDA graphs for decode batches (CUDA only); 3 = 2 with inductor's
    autotuning. `level=None` picks the device default: 0 on CPU (compiling costs minutes on small machines), 2 on
    CUDA; $VLSERVE_DEFAULT_COMPILE_LEVEL, when set, replaces that default (the test suite sets 0 on CUDA). `cudagraph_capture_sizes`: padded batch sizes captured (default `default_capture_sizes(max_num_seqs)`);
    `cache_dir`: inductor's on-disk cache (default `default_compile_cache_dir()`). `inductor_compile_config`: options
    handed to inductor (vLLM's name) over the defaults: on CPU `CPU_INDUCTOR_DEFAULTS` (weights become constants and
    linear layers run on oneDNN with prepacked weights, which keeps a second, packed copy of them; no size or alignment
    asserts on every op's output in every step), at level 3 on CUDA `{"max_autotune": True}`."""

    level: int | None = None
    cudagraph_capture_sizes: list[int] | None = None
    cache_dir: str | None = None
    inductor_compile_config: dict | None = None

    def __post_init__(self) -> None:
        if self.level is not None and (
            isinstance(self.level, bool) or not isinstance(self.level, int) or not 0 <= self.level <= 3
        ):
            raise ValueError(f"compilation_config level must be an integer 0..3, got {shorten(self.level)}")
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not isinstance(sizes, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in sizes
            ):
                raise ValueError(f"cudagraph_capture_sizes must be a list of integers, got {shorten(sizes)}")
            if any(n < 1 for n in sizes):
                raise ValueError(f"cudagraph_capture_sizes must all be >= 1, got {shorten(sizes)}")
            self.cudagraph_capture_sizes = sorted(set(sizes))
        if self.inductor_compile_config is not None and not isinstance(self.inductor_compile_config, dict):
            raise ValueError(
                f"inductor_compile_config must be a JSON object of inductor options, "
                f"got {shorten(self.inductor_compile_config)}"
            )

    @classmethod
    def from_value(cls, value: int | str | dict | CompilationConfig | None) -> CompilationConfig:
        """An int level (or its string, as `-O3` gives), a dict of the fields, JSON of one, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                return cls(level=int(text))
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(
                    f"compilation_config must be a level 0..3 or a JSON object, got {shorten(value)}"
                ) from None
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(level=value)
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be an int level or a dict, got {shorten(value)}")
        unknown = sorted(set(value) - {"level", "cudagraph_capture_sizes", "cache_dir", "inductor_compile_config"})
        if unknown:
            raise ValueError(
                f"compilation_config has unknown keys {shorten(unknown)}; "
                f"expected level, cudagraph_capture_sizes, cache_dir, inductor_compile_config"
            )
        return cls(**value)

    def inductor_options(self, device_type: str) -> dict:
        """Inductor's options on this device: the defaults above, then `inductor_compile_config` over them."""
        defaults = dict(CPU_INDUCTOR_DEFAULTS) if device_type == "cpu" else {}
        if device_type == "cuda" and self.level == 3:
            defaults["max_autotune"] = True
        return {**defaults, **(self.inductor_compile_config or {})}

    def resolved_level(self, device_type: str, enforce_eager: bool = False) -> int:
        """The level that runs on this device: 0 under enforce_eager; the device default when unset."""
        if enforce_eager:
            return 0
        if self.level is None:
            forced = os.environ.get(DEFAULT_LEVEL_ENV, "").strip()
            if forced:
                if forced not in ("0", "1", "2", "3"):
                    raise ValueError(f"${DEFAULT_LEVEL_ENV} must be 0..3, got {forced[:20]!r}")
                return int(forced)
            return 2 if device_type == "cuda" else 0
        return self.level


@dataclass
class EngineArgs:
    """Everything `LLM(...)` and `vlserve serve` accept (vLLM's names where the meaning is the same)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # the checkpoint's quant method, checked against its quantization_config
    mm_encoder_quantization: str | None = None  # "int8": the towers' linears W8A8 at load (CPU; models.quantization)
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.25  # of available memory, when profiling decides the KV size
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: the model dtype, or float8_e4m3fn with per-layer scales
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "auto"
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] | None = None  # HF processor kwargs; {"use_fast": false}: the slow one
    # drop this fraction of each Qwen2-VL / Qwen2.5-VL video's tokens, the least changed (multimodal/video_pruning.py)
    video_pruning_rate: float = 0.0
    mm_preprocess_workers: int = 4  # threads that tokenize, decode media and run the HF processor off the loop
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None  # embeddings encoded per step (None: sized in time, below)
    encoder_step_ms: float = 150.0  # adaptive budget: a step's encoder work ~ max(one decode step, this many ms)
    max_waiting_requests: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (SchedulerConfig.scheduling_policy)
    speculative_config: dict[str, Any] | None = None
    structured_outputs_config: Any = None  # StructuredOutputsConfig, its dict or JSON text (None: xgrammar)
    # how reasoning ends in the output (vlserve.reasoning: "qwen3", "deepseek_r1"): grammars start after it, and
    # requests may set thinking_token_budget; the server splits reasoning from content with it. None: off
    reasoning_parser: str | None = None
    served_model_name: str | None = None
    chat_template_content_format: str = "auto"  # "auto" | "string" | "openai": what the chat template's content is
    # default sampling parameters: "auto" (the checkpoint's generation_config.json), "vlserve" (built-in) or a directory
    generation_config: str = "auto"
    max_audio_seconds: float | None = None  # longest audio clip accepted (None: the feature extractor's window)
    # video bounds of the multimodal processor (None: its defaults, 256 frames and 1280x720, see video_frame_size.py):
    # frames kept per video after sampling (a request's num_frames above it is a 400), pixels per decoded frame
    max_video_frames: int | None = None
    max_video_frame_pixels: int | None = None
    async_scheduling: bool = False  # plan step N+1 and process step N's outputs while step N runs
    compilation_config: CompilationConfig | dict | int | str | None = None  # see CompilationConfig (-O0..-O3)
    enforce_eager: bool = False  # no torch.compile, no CUDA graphs (vLLM's flag)
    data_parallel_size: int = 1  # engine processes (replicas) behind one `vlserve serve`
    tensor_parallel_size: int = 1  # worker processes (ranks) the model is sharded over
    # pipeline stages: the decoder layers split into contiguous runs (even, or as $VLSERVE_PP_LAYER_PARTITION says),
    # tensor_parallel_size ranks (processes) each; synchronous; a VLM encodes on the first stage
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "mp" (default) or "ray": what starts the ranks
    mm_encoder_tp_mode: str = "weights"  # one of MM_ENCODER_TP_MODES; no effect at tensor_parallel_size 1
    # LoRA (vlserve.lora): PEFT adapters on the decoder's projections, chosen per request
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step (device slots)
    max_lora_rank: int = 16  # the largest adapter rank accepted
    max_cpu_loras: int | None = None  # parsed adapters kept in host memory (None: max_loras)
    lora_modules: dict[str, str] | None = None  # name -> PEFT adapter directory, served as models by name
    # KV connector (vlserve/distributed/kv_transfer): KVTransferConfig, its dict or JSON text; None: off
    kv_transfer_config: Any = None
    # KV offloading below the device pool (vLLM's --kv-offloading-size, GiB of host memory), and a disk tier under
    # it (a directory that outlives the engine); either one turns on the OffloadingConnector
    kv_offloading_size: float | None = None
    kv_offloading_dir: str | None = None
    kv_offloading_dir_size: float | None = None  # GiB cap of the disk tier (least recently used files go first)
    # encoder-cache connector (vlserve/distributed/ec_transfer): ECTransferConfig, its dict or JSON text; None: off
    ec_transfer_config: Any = None
    # an encode server (E/PD, vLLM's --mm-encoder-only; an ec_producer turns it on): core/encoder_only_scheduler.py
    mm_encoder_only: bool = False
    # pooling (vlserve/pooling_params.py): "pooling" runs prefill only and returns pooled hidden states; "auto" picks
    # it for a converted or *ForSequenceClassification checkpoint. convert: "embed" / "classify" a generative one
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Any = None  # PoolerConfig, its dict or JSON text: overrides the checkpoint's pooling settings
    hf_overrides: dict[str, Any] | str | None = None  # vLLM's reranker keys only (pooling_params.apply_hf_overrides)
    # live video sessions (vlserve/engine/video_session.py): at most this many open; closed after this long idle (s)
    max_video_sessions: int = 8
    session_idle_timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {shorten(value)}")
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ValueError(
                f"distributed_executor_backend must be 'mp' or 'ray', got {shorten(self.distributed_executor_backend)}"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size x "
                f"pipeline_parallel_size is {self.world_size}: use 'mp' or 'ray'"
            )
        if isinstance(self.limit_mm_per_prompt, str):
            self.limit_mm_per_prompt = json.loads(self.limit_mm_per_prompt)
        self.structured_outputs_config = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # an unknown name fails here, before anything loads
        if isinstance(self.speculative_config, str):
            self.speculative_config = json.loads(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32"):
            raise ValueError(f"dtype must be one of auto/float32/bfloat16/float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {shorten(self.kv_cache_dtype)}"
            )
        if self.mm_encoder_tp_mode not in MM_ENCODER_TP_MODES:
            raise ValueError(f"mm_encoder_tp_mode must be one of weights, data, got {shorten(self.mm_encoder_tp_mode)}")
        if self.mm_encoder_quantization not in (None, "int8"):
            raise ValueError(
                f"mm_encoder_quantization must be None or 'int8', got {shorten(self.mm_encoder_quantization)}"
            )
        if self.mm_encoder_quantization is not None and str(self.device).startswith("cuda"):
            raise ValueError("mm_encoder_quantization='int8' runs on the CPU only for now (device='cpu')")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        n_enc = self.max_num_encoder_input_tokens
        if n_enc is not None and (isinstance(n_enc, bool) or not isinstance(n_enc, int) or n_enc < 1):
            raise ValueError(f"max_num_encoder_input_tokens must be an integer >= 1, got {shorten(n_enc)}")
        step_ms = self.encoder_step_ms
        if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)) or not step_ms >= 0:
            raise ValueError(f"encoder_step_ms must be a number of milliseconds >= 0, got {shorten(step_ms)}")
        workers = self.mm_preprocess_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"mm_preprocess_workers must be an integer >= 1, got {shorten(workers)}")
        rate = self.video_pruning_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"video_pruning_rate must be a number in [0, 1), got {shorten(rate)}")
        self.video_pruning_rate = float(rate)
        if self.video_pruning_rate and self.pipeline_parallel_size > 1:
            raise ValueError("video_pruning_rate needs every rank to encode: not with pipeline_parallel_size > 1")
        mm_kwargs = self.mm_processor_kwargs if isinstance(self.mm_processor_kwargs, dict) else {}
        use_fast = mm_kwargs.get("use_fast", True)
        if not isinstance(use_fast, bool):
            raise ValueError(f"mm_processor_kwargs.use_fast must be true or false, got {shorten(use_fast)}")
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                f"chat_template_content_format must be auto/string/openai, "
                f"got {shorten(self.chat_template_content_format)}"
            )
        sessions = self.max_video_sessions
        if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
            raise ValueError(f"max_video_sessions must be an integer >= 1, got {shorten(sessions)}")
        if not isinstance(self.session_idle_timeout, (int, float)) or not self.session_idle_timeout > 0:
            raise ValueError(f"session_idle_timeout must be > 0 seconds, got {shorten(self.session_idle_timeout)}")
        if self.max_audio_seconds is not None and not self.max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds must be > 0, got {shorten(self.max_audio_seconds)}")
        for name in ("max_video_frames", "max_video_frame_pixels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {shorten(value)}")
        if self.model is not None:
            self.model = os.path.expanduser(str(self.model))
        self.compilation_config = CompilationConfig.from_value(self.compilation_config)
        self.pooler_config = PoolerConfig.from_any(self.pooler_config)
        self.convert, self.pooler_config = apply_hf_overrides(self.hf_overrides, self.convert, self.pooler_config)
        check_runner_args(self.runner, self.convert)
        self._resolve_kv_transfer()
        self.ec_transfer_config = ECTransferConfig.from_any(self.ec_transfer_config)
        self._check_encoder_only()
        self._check_lora()
        self._check_pipeline_parallel()

    def _resolve_kv_transfer(self) -> None:
        """kv_transfer_config to a KVTransferConfig; --kv-offloading-size / --kv-offloading-dir are the
        OffloadingConnector's settings (vLLM: the size flag sets up the offloading connector)."""
        self.kv_transfer_config = KVTransferConfig.from_any(self.kv_transfer_config)
        size, path, dir_size = self.kv_offloading_size, self.kv_offloading_dir, self.kv_offloading_dir_size
        if size is None and path is None and dir_size is None:
            return
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0):
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {shorten(size)}")
        if dir_size is not None and (
            isinstance(dir_size, bool) or not isinstance(dir_size, (int, float)) or not dir_size > 0
        ):
            raise ValueError(f"kv_offloading_dir_size must be a number of GiB > 0, got {shorten(dir_size)}")
        extra = {} if size is None and path is None else {"cpu_bytes_to_use": int((size or 0) * (1 << 30))}
        if path is not None:
            extra["disk_dir"] = os.path.expanduser(str(path))
        if dir_size is not None:
            extra["disk_bytes_to_use"] = int(dir_size * (1 << 30))
        cfg = self.kv_transfer_config
        if cfg is None:
            self.kv_transfer_config = KVTransferConfig("OffloadingConnector", "kv_both", extra)
        elif cfg.kv_connector != "OffloadingConnector":
            raise ValueError(
                f"kv_offloading_size / kv_offloading_dir configure the OffloadingConnector, but "
                f"kv_transfer_config names {shorten(cfg.kv_connector)}"
            )
        else:
            cfg.kv_connector_extra_config = {**extra, **cfg.kv_connector_extra_config}
        if "disk_dir" not in self.kv_transfer_config.kv_connector_extra_config:
            if dir_size is not None:
                raise ValueError("kv_offloading_dir_size caps the disk tier: give kv_offloading_dir too")

    def _check_encoder_only(self) -> None:
        """As vLLM: an ec_producer is an encode server (mm_encoder_only): it needs that role and generates nothing."""
        ec = self.ec_transfer_config
        self.mm_encoder_only = bool(self.mm_encoder_only or (ec is not None and ec.ec_role == "ec_producer"))
        if self.mm_encoder_only and (ec is None or ec.ec_role != "ec_producer"):
            raise ValueError(
                "mm_encoder_only publishes encoder outputs: it needs ec_transfer_config with ec_role "
                f'"ec_producer" (ec_both encodes, publishes and generates), got {ec and ec.ec_role!r}'
            )
        bad = [
            name
            for name, on in (
                ("kv_transfer_config", self.kv_transfer_config is not None),
                ("speculative_config", self.speculative_config is not None),
                ("enable_lora", self.enable_lora),
                ("async_scheduling", self.async_scheduling),
            )
            if on and self.mm_encoder_only
        ]
        if bad:
            raise ValueError(f"mm_encoder_only (an ec_producer) generates nothing: {bad[0]} does not apply")

    def processor_kwargs(self) -> dict[str, Any]:
        """Every request's processor kwargs before its own: `mm_processor_kwargs`, and the video pruning rate."""
        kwargs = dict(self.mm_processor_kwargs or {})
        if self.video_pruning_rate:
            kwargs["video_pruning_rate"] = self.video_pruning_rate
        return kwargs

    @property
    def world_size(self) -> int:
        """Worker ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline_parallel(self) -> None:
        """Refuse what pipeline parallelism does not support yet, rather than ignore it."""
        if self.pipeline_parallel_size == 1:
            return
        pp = f"pipeline_parallel_size={self.pipeline_parallel_size}"
        refused = [
            (self.data_parallel_size > 1, "with data_parallel_size > 1"),
            (
                names_eagle(self.speculative_config),
                "with EAGLE speculative decoding (the draft head reads the "
                "target's hidden states and embeddings, which live on different "
                "stages; use method 'ngram')",
            ),
            (self.async_scheduling, "with async_scheduling"),
            (self.enable_lora, "with LoRA"),
            (self.quantization is not None, "with a quantized checkpoint"),
            (
                self.compilation_config.level not in (None, 0),
                "with torch.compile or CUDA graphs (the stages run eager: compilation level 0 or enforce_eager)",
            ),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"{pp} is not supported {what} yet")

    def _check_lora(self) -> None:
        """LoRA knobs: integers >= 1, max_cpu_loras >= max_loras, adapters only with enable_lora; `lora_modules`
        also as vLLM's "name=path" strings (or {"name", "path"} dicts)."""
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {shorten(value)}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {shorten(cpu)}")
        self.lora_modules = parse_lora_modules(self.lora_modules)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules were given but LoRA is off: add enable_lora=True (--enable-lora)")
        if self.enable_lora and self.async_scheduling and self.world_size > 1:  # ranks elsewhere answer the
            # adapter loads' calls in order with the steps, and a step is in flight under async scheduling
            raise ValueError("LoRA with async_scheduling is not supported yet with tensor or pipeline parallel ranks")


def names_eagle(speculative_config: Any) -> bool:
    """Whether a speculative_config (dict, before validation) asks for an EAGLE draft: by method, or by a draft model
    whose name says so (as SpeculativeConfig infers a missing method)."""
    if not isinstance(speculative_config, dict):
        return bool(getattr(speculative_config, "use_eagle", False))  # a SpeculativeConfig, or None
    what = speculative_config.get("method") or speculative_config.get("model") or ""
    return "eagle" in str(what).lower()


def parse_lora_modules(value) -> dict[str, str] | None:
    """`lora_modules` as {name: path}: from a dict, or a list of "name=path" strings / {"name", "path"} dicts."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for v in value:
            if isinstance(v, str) and "=" in v:
                items.append(tuple(v.split("=", 1)))
            elif isinstance(v, dict) and "name" in v and "path" in v:
                items.append((v["name"], v["path"]))
            else:
                raise ValueError(f'a LoRA module must be \'name=path\' or {{"name", "path"}}, got {shorten(v)}')
    else:
        raise ValueError(f"lora_modules must be a dict of name -> path or a list of 'name=path', got {shorten(value)}")
    out: dict[str, str] = {}
    for name, path in items:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"a LoRA module needs a non-empty name and path, got {shorten((name, path))}")
        if name in out:
            raise ValueError(f"LoRA module name {name!r} is given twice")
        out[name] = os.path.expanduser(path)
    return out


def resolve_model_path(model: str | None) -> str:
    """A local checkpoint directory, checked for config.json (no hub downloads here). None means the embedded demo
    model; the names "vlserve-demo" and "vlserve-demo-audio" mean the shipped checkpoints (vlserve.demo) unless a
    local directory of that name exists."""
    from vlserve.demo import DEMO_MODELS, demo_model_path  # the embedded demo models

    if model is None:
        model = demo_model_path("vlserve-demo")
    elif model in DEMO_MODELS and not os.path.isdir(model):
        model = demo_model_path(model)
    if not os.path.isdir(model):
        raise ValueError(
            f"model path {model!r} is not a local directory; vlserve loads Hugging Face checkpoints "
            f"from disk (config.json + *.safetensors + tokenizer files)."
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    return model
