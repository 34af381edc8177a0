"""The flags of `vlserve serve`, named and grouped as vLLM's (`--max-model-len`, `--limit-mm-per-prompt
'{"image":4}'`, `--api-key`, ...); their help formatter and description are in `serve_help.py`."""

from __future__ import annotations

import argparse
import json

from vlserve.reasoning import reasoning_parser_names


def _json_dict(value: str) -> dict:
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return out


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `vlserve serve`, in vLLM's groups (Frontend, ModelConfig, ...): one line of help and the
    default each."""
    front = p.add_argument_group("Frontend", "the HTTP server (the API process)")
    front.add_argument("--host", default="127.0.0.1", help="address to listen on")
    front.add_argument("--port", type=int, default=8000, help="port to listen on")
    front.add_argument("--api-key", default=None, help="Bearer KEY on /v1/*; WebSockets: ?api_key=KEY (default: none)")
    front.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="message content the chat template takes: one string, or a list of parts "
        "(default: auto, detected from the template)",
    )
    front.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="honour chat templates sent in requests (chat_template, chat_template_kwargs); they run "
        "client-written Jinja in the server, so only for trusted clients (default: refused)",
    )
    front.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser (default: off)',
    )
    front.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls are read out of the model's text (hermes: <tool_call>{...}</tool_call>) (default: none)",
    )
    front.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="stored Responses kept for previous_response_id and GET /v1/responses/{id}; the least recently used "
        "go first (default: 1000)",
    )
    front.add_argument(
        "--reasoning-parser",
        default=None,
        choices=reasoning_parser_names(),
        help="how the model's reasoning ends (qwen3, deepseek_r1: <think>...</think>): replies carry it apart from "
        "the content, grammars start after it, requests may set thinking_token_budget (default: none)",
    )
    front.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted, in bytes; larger ones get 413 (default: 64 MiB)",
    )
    front.add_argument(
        "--mm-preprocess-workers",
        type=int,
        default=4,
        help="threads in the API process that tokenize prompts, decode and resize media and run the "
        "HF processor, off the event loop",
    )
    front.add_argument(
        "--disable-playground",
        action="store_true",
        help="do not serve the playground page at / and /playground (default: served)",
    )
    front.add_argument(
        "--no-engine-process",
        dest="engine_process",
        action="store_false",
        help="run the engine core in a thread of the API process (default: in its own process)",
    )
    front.add_argument(
        "--engine-process",
        dest="engine_process",
        action="store_true",
        help="run the engine core in its own process (the default; `make serve` of the demo model turns it off)",
    )
    front.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level of both processes",
    )

    model = p.add_argument_group("ModelConfig", "the checkpoint and how it is loaded")
    model.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local checkpoint directory, or vlserve-demo / vlserve-demo-audio (default: the "
        "embedded demo model, vlserve-demo)",
    )
    model.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        default=None,
        help="same as the positional MODEL (default: the positional one)",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported (default: the MODEL argument)",
    )
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: MODEL's own)")
    model.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): "
        "auto reads MODEL's generation_config.json, vlserve keeps the built-in ones, a directory is read for its "
        "generation_config.json; a request's own fields win",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32"],
        help="weight and activation dtype (default: auto, the checkpoint's dtype)",
    )
    model.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["compressed-tensors", "gptq", "awq"],
        help="the checkpoint's quantization method; it must match quantization_config in its "
        "config.json, which is read either way (default: from the checkpoint)",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence, prompt plus completion, in tokens (default: the model's max_position_embeddings)",
    )
    model.add_argument(
        "--seed", type=int, default=0, help="torch's global seed (sampling of requests without a seed of their own)"
    )
    model.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="directory that file:// media URLs may read from (default: file:// disabled)",
    )
    model.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="hosts that http(s) media URLs may come from, space- or comma-separated (default: any)",
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile and no CUDA graphs, whatever -O says (default: off)",
    )

    device = p.add_argument_group("DeviceConfig")
    device.add_argument(
        "--device", default="auto", help="cpu, cuda or cuda:N (default: auto, CUDA when torch sees a GPU, else the CPU)"
    )

    mm = p.add_argument_group("MultiModalConfig", "images, videos and audio")
    mm.add_argument(
        "--limit-mm-per-prompt",
        type=_json_dict,
        default=None,
        help='per-prompt media caps, e.g. \'{"image":4,"video":1}\' (default: no cap)',
    )
    mm.add_argument(
        "--mm-processor-kwargs",
        type=_json_dict,
        default=None,
        help="HF processor kwargs for every media item, e.g. '{\"max_pixels\":200704}'; "
        "'{\"use_fast\":false}' loads the slow (PIL) image processor (default: none; the fast "
        "image processor where transformers has one)",
    )
    mm.add_argument(
        "--video-pruning-rate",
        type=float,
        default=0.0,
        help="drop this fraction in [0, 1) of a Qwen-VL video's least-changed tokens (EVS); requests may override",
    )
    mm.add_argument(
        "--media-io-kwargs",
        type=_json_dict,
        default=None,
        help='defaults of the per-request media_io_kwargs, e.g. \'{"video":{"num_frames":8}}\' (or fps); a '
        "request's value replaces them (default: every frame, up to the frame cap)",
    )
    mm.add_argument(
        "--enable-mm-embeds",
        action="store_true",
        help="accept image_embeds content parts (precomputed tower embeddings; default: refused)",
    )
    mm.add_argument(
        "--max-video-frames",
        type=int,
        default=None,
        help="frames kept from one video after sampling (default 256); a request's num_frames above it is refused",
    )
    mm.add_argument(
        "--max-video-frame-pixels",
        type=int,
        default=None,
        help="decoded video frames with more pixels are scaled down as they are decoded, aspect kept (default "
        "1280*720; Qwen2-VL-family frames are decoded at the size their processor resizes them to)",
    )
    mm.add_argument("--max-video-sessions", type=int, default=8, help="live video sessions open at once (then 429)")
    mm.add_argument("--session-idle-timeout", type=float, default=600.0, help="idle seconds that end a video session")
    mm.add_argument(
        "--max-audio-seconds",
        type=float,
        default=None,
        help="longest audio clip accepted (default and upper bound: the model's feature-extractor "
        "window, 30 s for Whisper's)",
    )
    mm.add_argument(
        "--mm-encoder-quantization",
        default=None,
        choices=["int8"],
        help="int8: the media towers' and projectors' linears quantized at load to W8A8 (int8 weights per output "
        "channel, int8 activations per token; AMX int8 tiles where the CPU has them); patch embeddings and norms "
        "stay float. CPU only (default: the towers run in the model dtype)",
    )
    mm.add_argument(
        "--mm-encoder-tp-mode",
        default="weights",
        choices=["weights", "data"],
        help="how the media towers use --tensor-parallel-size ranks: weights: the Qwen2-VL / Qwen2.5-VL / Qwen3-VL "
        "vision towers' blocks are split over the ranks like the decoder (other towers, and all with LoRA on, are "
        "replicated); data: each rank encodes its share of a step's images, videos and clips (balanced by size) and "
        "the embeddings are all-gathered. No effect on one rank",
    )
    mm.add_argument(
        "--mm-encoder-only",
        action="store_true",
        help="an encode server for E/PD disaggregation (vLLM's flag): only the media towers are loaded "
        "and run, no KV cache; each request's media items are encoded and published through "
        "--ec-transfer-config (ec_role ec_producer, which alone also turns this on) and it ends "
        'with no tokens (finish_reason "length")',
    )

    cache = p.add_argument_group("CacheConfig", "the paged KV cache")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes; on CPU $VLSERVE_CPU_KVCACHE_SPACE (GiB) sets it too (default: "
        "max-num-seqs x max-model-len tokens' worth, capped by 25%% of free memory less a "
        "profiled forward; the start-up log says what was reserved and why)",
    )
    cache.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks; wins over --kv-cache-memory-bytes (default: sized in bytes)",
    )
    cache.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="KV cache dtype: auto = the model's dtype; fp8 / fp8_e4m3 = float8_e4m3fn, half of bf16's "
        "memory, scaled per layer by the checkpoint's k_scale / v_scale, else 1.0 (default: auto)",
    )
    cache.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory for a KV tier below the device pool: full blocks are offloaded "
        "there (LRU) and loaded back on a prefix hit instead of recomputed (default: off)",
    )
    cache.add_argument(
        "--kv-offloading-dir",
        default=None,
        help="a directory for a disk KV tier under the host one (one file per block; it outlives "
        "the server, and another server of the same model can read it) (default: off)",
    )
    cache.add_argument(
        "--kv-offloading-dir-size",
        type=float,
        default=None,
        metavar="GIB",
        help="cap of the disk KV tier in GiB: the least recently used block files are deleted to "
        "stay under it (default: no cap)",
    )
    cache.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn prefix caching off (default: on)",
    )

    sched = p.add_argument_group("SchedulerConfig", "what each engine step runs")
    sched.add_argument("--max-num-seqs", type=int, default=128, help="requests running at once")
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (default: max-model-len clamped to 2048..8192)",
    )
    sched.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="reject new requests with 503 while this many wait (default: no limit)",
    )
    sched.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="waiting order: fcfs (arrival), or priority (a request's priority field, lower first, ties by arrival; "
        "a lower-priority running request is preempted first when KV blocks run out)",
    )
    sched.add_argument(
        "--async-scheduling",
        action="store_true",
        help="plan the next step and process outputs while the current step runs; same outputs (default: off)",
    )
    sched.add_argument(
        "--max-num-encoder-input-tokens",
        type=int,
        default=None,
        help="media embeddings encoded per step, so a burst of images does not stall running "
        "streams (default: adaptive, sized in time: see --encoder-step-ms)",
    )
    sched.add_argument(
        "--encoder-step-ms",
        type=float,
        default=150.0,
        help="with the adaptive budget, the encoder work of one step takes about the longer of one "
        "decode step and this many ms: more lets images share tower calls and steps (more "
        "throughput), less keeps running streams' inter-token latency lower (0: one decode step)",
    )
    sched.add_argument(
        "--encoder-cache-size",
        type=int,
        default=None,
        help="media embeddings the encoder cache holds (default: max-num-batched-tokens, at least 8192)",
    )

    par = p.add_argument_group("ParallelConfig", "processes and ranks")
    par.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine processes (replicas, each with its own KV and encoder cache) behind this server; "
        "requests go by media / prompt-prefix affinity, then load",
    )
    par.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks (worker processes, one device each; gloo on CPU, NCCL on CUDA) the model is sharded over",
    )
    par.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages the decoder layers are split over, evenly or as "
        "$VLSERVE_PP_LAYER_PARTITION says (e.g. '10,14'); each stage is --tensor-parallel-size "
        "ranks (processes or Ray actors)",
    )
    par.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=None,
        help="what starts the ranks: mp (multiprocessing) or ray (Ray actors on the cluster at "
        "RAY_ADDRESS, or a local one) (default: mp above one rank)",
    )

    kvt = p.add_argument_group("KVTransferConfig", "KV connectors (disaggregated serving, KV offloading)")
    kvt.add_argument(
        "--kv-transfer-config",
        type=_json_dict,
        default=None,
        help='JSON, as vLLM: \'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"cpu_bytes_to_use": 4e9, "disk_dir": "/tmp/kv"}}\' '
        "(kv_role: kv_producer | kv_consumer | kv_both) (default: none)",
    )

    kvt.add_argument(
        "--ec-transfer-config",
        type=_json_dict,
        default=None,
        help='JSON, as vLLM: \'{"ec_connector": "shared_storage", "ec_role": "ec_producer", '
        '"ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}\' (ec_role: ec_producer | '
        "ec_consumer | ec_both): encoder outputs through a shared directory (default: none)",
    )

    # pooling models (embeddings, classifiers, rerankers): vLLM lists these under ModelConfig
    model.add_argument(
        "--runner",
        choices=["auto", "generate", "pooling"],
        default="auto",
        help="pooling: prefill only, each prompt's final hidden states pooled (embeddings, scores) instead of "
        "generating (default auto: pooling for --convert embed|classify or a *ForSequenceClassification checkpoint)",
    )
    model.add_argument(
        "--convert",
        choices=["auto", "none", "embed", "classify"],
        default="auto",
        help="serve a generative checkpoint as an embedder (last-token pooling, normalized) or a classifier "
        '(with --pooler-config classifier_from_token, e.g. ["no", "yes"] for a yes/no reranker)',
    )
    model.add_argument(
        "--pooler-config",
        type=_json_dict,
        default=None,
        help='JSON: {"pooling_type": "LAST|MEAN|CLS|ALL", "normalize": true, "classifier_from_token": [...]}; '
        "overrides the checkpoint's sentence-transformers modules.json / 1_Pooling/config.json (default: the "
        "checkpoint's settings, else LAST pooling, normalized for embed)",
    )

    model.add_argument(
        "--hf-overrides",
        type=_json_dict,
        default=None,
        help='vLLM\'s reranker overrides only: {"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true} (= --convert classify '
        "with those tokens); other keys are refused (default: none)",
    )

    spec = p.add_argument_group("SpeculativeConfig")
    spec.add_argument(
        "--speculative-config",
        type=_json_dict,
        default=None,
        help='JSON, e.g. \'{"method": "eagle", "num_speculative_tokens": 4}\' (on the demo model, its '
        'own EAGLE head) or \'{"method": "ngram", "num_speculative_tokens": 3}\' (default: none)',
    )

    structured = p.add_argument_group("StructuredOutputsConfig")
    structured.add_argument(
        "--structured-outputs-config",
        type=_json_dict,
        default=None,
        help='JSON: {"backend": "xgrammar" | "guidance", "disable_any_whitespace": false} '
        "(default: xgrammar, JSON with any whitespace)",
    )

    lora = p.add_argument_group("LoRAConfig", "PEFT LoRA adapters served next to the base model")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (a request picks one by model name; LoRA engines run eager)",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve: NAME=PATH of a PEFT adapter directory, one or more "
        "(default: none; VLSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 allows loading more at runtime)",
    )
    lora.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one engine step")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    lora.add_argument(
        "--max-cpu-loras", type=int, default=None, help="parsed adapters kept in host memory (default: --max-loras)"
    )

    comp = p.add_argument_group("CompilationConfig")
    comp.add_argument(
        "-O",
        "--compilation-config",
        dest="compilation_config",
        default=None,
        help="compilation level 0..3 (-O0 eager, -O1 torch.compile, -O2 + CUDA graphs, -O3 + "
        'autotuning) or a JSON object, e.g. \'{"level":2,"cudagraph_capture_sizes":[1,2,4]}\' '
        "(default: 0 on CPU, 2 on CUDA)",
    )
