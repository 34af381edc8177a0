"""`vlserve` command line: `vlserve serve [MODEL] ...`, `vlserve bench throughput ...`, `vlserve bench serve ...`.

Flag names follow vLLM's (`--max-model-len`, `--limit-mm-per-prompt '{"image":4}'`, `--api-key`, ...).
"""

from __future__ import annotations

import argparse
import logging
import sys

from vlserve.serve_args import add_serve_args
from vlserve.serve_help import SERVE_DESCRIPTION, HelpFormatter


def serve_config_from_args(args: argparse.Namespace):
    """(EngineArgs, ServerConfig) from parsed `vlserve serve` flags."""
    from vlserve.api.media import MediaConfig
    from vlserve.api.server import ServerConfig
    from vlserve.config import EngineArgs

    names = args.served_model_name
    engine_args = EngineArgs(
        model=args.model_flag or args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        mm_encoder_quantization=args.mm_encoder_quantization,
        mm_encoder_tp_mode=args.mm_encoder_tp_mode,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        device=args.device,
        limit_mm_per_prompt=args.limit_mm_per_prompt or {},
        mm_processor_kwargs=args.mm_processor_kwargs,
        video_pruning_rate=args.video_pruning_rate,
        mm_preprocess_workers=args.mm_preprocess_workers,
        encoder_cache_size=args.encoder_cache_size,
        max_waiting_requests=args.max_waiting_requests,
        scheduling_policy=args.scheduling_policy,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        encoder_step_ms=args.encoder_step_ms,
        speculative_config=args.speculative_config,
        structured_outputs_config=args.structured_outputs_config,
        reasoning_parser=args.reasoning_parser,
        served_model_name=names[0] if names else None,
        chat_template_content_format=args.chat_template_content_format,
        generation_config=args.generation_config,
        max_audio_seconds=args.max_audio_seconds,
        max_video_frames=args.max_video_frames,
        max_video_frame_pixels=args.max_video_frame_pixels,
        max_video_sessions=args.max_video_sessions,
        session_idle_timeout=args.session_idle_timeout,
        async_scheduling=args.async_scheduling,
        compilation_config=args.compilation_config,
        enforce_eager=args.enforce_eager,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=args.lora_modules,
        kv_transfer_config=args.kv_transfer_config,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_dir=args.kv_offloading_dir,
        kv_offloading_dir_size=args.kv_offloading_dir_size,
        ec_transfer_config=args.ec_transfer_config,
        mm_encoder_only=args.mm_encoder_only,
        runner=args.runner,
        convert=args.convert,
        pooler_config=args.pooler_config,
        hf_overrides=args.hf_overrides,
    )
    body_cap = {} if args.max_request_body_bytes is None else {"max_body_bytes": args.max_request_body_bytes}
    config = ServerConfig(
        served_model_names=names,
        api_key=args.api_key,
        trust_request_chat_template=args.trust_request_chat_template,
        **body_cap,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        responses_store_size=args.responses_store_size,
        playground=not args.disable_playground,
        media=MediaConfig(
            allowed_local_media_path=args.allowed_local_media_path,
            allowed_media_domains=_split_domains(args.allowed_media_domains),
            media_io_kwargs=args.media_io_kwargs,
            enable_mm_embeds=args.enable_mm_embeds,
        ),
    )
    return engine_args, config


def run_serve(args: argparse.Namespace) -> int:
    """Build EngineArgs + ServerConfig from the flags and serve."""
    from vlserve.api.server import serve

    engine_args, config = serve_config_from_args(args)
    return serve(engine_args, args.host, args.port, config, args.log_level, engine_process=args.engine_process)


def build_parser() -> argparse.ArgumentParser:
    """The `vlserve` argument parser (serve flags; bench subcommands parse their own)."""
    parser = argparse.ArgumentParser(
        prog="vlserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(
        sub.add_parser(
            "serve",
            help="run the OpenAI-compatible server",
            description=SERVE_DESCRIPTION,
            formatter_class=HelpFormatter,
        )
    )
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench.add_parser("throughput", help="offline throughput (see --help)", add_help=False)
    bench.add_parser("serve", help="load-test a running server over the OpenAI API", add_help=False)
    bench.add_parser("mm-cache", help="repeated images: encoder cache on vs off", add_help=False)
    bench.add_parser("spec-decode", help="speculative vs plain decoding", add_help=False)
    bench.add_parser("spec-demo", help="speculative vs plain decoding on the demo model's task", add_help=False)
    sub.add_parser(
        "proxy",
        help="disaggregated serving proxy (encode, prefill, decode) in front of vlserve servers (see --help)",
        add_help=False,
    )
    return parser


def _split_domains(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [d.strip() for v in values for d in v.split(",") if d.strip()]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vlserve` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:2] == ["bench", "throughput"]:
        from vlserve.bench.throughput import main as throughput_main

        return throughput_main(argv[2:]) or 0
    if argv[:2] == ["bench", "serve"]:
        from vlserve.bench.serve import main as serve_bench_main

        return serve_bench_main(argv[2:]) or 0
    if argv[:2] == ["bench", "mm-cache"]:
        from vlserve.bench.mm_cache import main as mm_cache_main

        return mm_cache_main(argv[2:]) or 0
    if argv[:2] == ["bench", "spec-decode"]:
        from vlserve.bench.spec_decode import main as spec_bench_main

        return spec_bench_main(argv[2:]) or 0
    if argv[:2] == ["bench", "spec-demo"]:
        from vlserve.bench.spec_demo import main as spec_demo_main

        return spec_demo_main(argv[2:]) or 0
    if argv[:1] == ["proxy"]:
        from vlserve.api.disagg_proxy import main as proxy_main

        return proxy_main(argv[1:]) or 0
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    from vlserve.engine.core_client import EngineStartupError

    try:
        return run_serve(args)
    except (ValueError, ModuleNotFoundError, EngineStartupError) as e:
        if isinstance(e, ModuleNotFoundError) and e.name != "vlserve.demo":
            raise
        print(f"vlserve serve: error: {_explain(e, args)}", file=sys.stderr)
        return 2


def _explain(e: Exception, args: argparse.Namespace) -> str:
    if isinstance(e, ModuleNotFoundError) or (
        args.model is None and args.model_flag is None and "demo" in str(e).lower()
    ):
        return (
            "no MODEL given and the embedded demo model is not available in this install; pass a local "
            f"checkpoint directory: vlserve serve /path/to/model ({e})"
        )
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
