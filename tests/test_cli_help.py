"""`vlserve serve --help`: every flag has one line of help and shows its default, in vLLM's argument groups; the
flags, their destinations and their defaults are the ones `vlserve serve` always had (parsing only: no torch)."""

from __future__ import annotations

import argparse

import pytest

from vlserve.cli import build_parser

# dest -> default of every `vlserve serve` flag (what the flags parsed to before they were grouped)
DEFAULTS = {
    "model": None,
    "model_flag": None,
    "host": "127.0.0.1",
    "port": 8000,
    "served_model_name": None,
    "tokenizer": None,
    "generation_config": "auto",
    "dtype": "auto",
    "quantization": None,
    "max_model_len": None,
    "max_num_seqs": 128,
    "max_num_batched_tokens": None,
    "kv_cache_memory_bytes": None,
    "kv_cache_dtype": "auto",
    "num_kv_blocks": None,
    "block_size": 16,
    "enable_prefix_caching": True,
    "limit_mm_per_prompt": None,
    "mm_processor_kwargs": None,
    "video_pruning_rate": 0.0,
    "max_video_frames": None,
    "max_video_frame_pixels": None,
    "media_io_kwargs": None,
    "enable_mm_embeds": False,
    "mm_preprocess_workers": 4,
    "encoder_cache_size": None,
    "max_num_encoder_input_tokens": None,
    "encoder_step_ms": 150.0,
    "max_audio_seconds": None,
    "max_video_sessions": 8,
    "session_idle_timeout": 600.0,
    "allowed_local_media_path": None,
    "allowed_media_domains": None,
    "api_key": None,
    "trust_request_chat_template": False,
    "max_request_body_bytes": None,
    "speculative_config": None,
    "structured_outputs_config": None,
    "enable_auto_tool_choice": False,
    "tool_call_parser": None,
    "reasoning_parser": None,
    "responses_store_size": 1000,
    "max_waiting_requests": None,
    "scheduling_policy": "fcfs",
    "chat_template_content_format": "auto",
    "async_scheduling": False,
    "disable_playground": False,
    "compilation_config": None,
    "enforce_eager": False,
    "seed": 0,
    "device": "auto",
    "data_parallel_size": 1,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "distributed_executor_backend": None,
    "engine_process": True,
    "log_level": "info",
    "enable_lora": False,
    "lora_modules": None,
    "max_loras": 1,
    "max_lora_rank": 16,
    "max_cpu_loras": None,
    "kv_offloading_size": None,
    "kv_offloading_dir": None,
    "kv_offloading_dir_size": None,
    "kv_transfer_config": None,
    "ec_transfer_config": None,
    "mm_encoder_only": False,
    "mm_encoder_quantization": None,
    "mm_encoder_tp_mode": "weights",
    "runner": "auto",
    "convert": "auto",
    "pooler_config": None,
    "hf_overrides": None,
}
GROUPS = {  # group title -> flags vLLM puts there (vlserve's own flags where they fit)
    "Frontend": [
        "--host",
        "--port",
        "--api-key",
        "--chat-template-content-format",
        "--trust-request-chat-template",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--max-request-body-bytes",
        "--disable-playground",
        "--mm-preprocess-workers",
        "--no-engine-process",
        "--log-level",
    ],
    "ModelConfig": [
        "model",
        "--runner",
        "--convert",
        "--pooler-config",
        "--hf-overrides",
        "--model",
        "--served-model-name",
        "--tokenizer",
        "--generation-config",
        "--dtype",
        "--quantization",
        "-q",
        "--max-model-len",
        "--seed",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--enforce-eager",
    ],
    "DeviceConfig": ["--device"],
    "MultiModalConfig": [
        "--limit-mm-per-prompt",
        "--mm-processor-kwargs",
        "--video-pruning-rate",
        "--media-io-kwargs",
        "--enable-mm-embeds",
        "--max-audio-seconds",
        "--mm-encoder-only",
        "--mm-encoder-quantization",
        "--mm-encoder-tp-mode",
    ],
    "CacheConfig": [
        "--block-size",
        "--kv-cache-memory-bytes",
        "--num-kv-blocks",
        "--kv-cache-dtype",
        "--no-enable-prefix-caching",
        "--kv-offloading-size",
        "--kv-offloading-dir",
        "--kv-offloading-dir-size",
    ],
    "KVTransferConfig": ["--kv-transfer-config"],
    "SchedulerConfig": [
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-waiting-requests",
        "--scheduling-policy",
        "--async-scheduling",
        "--max-num-encoder-input-tokens",
        "--encoder-step-ms",
        "--encoder-cache-size",
    ],
    "ParallelConfig": [
        "--data-parallel-size",
        "-dp",
        "--tensor-parallel-size",
        "-tp",
        "--pipeline-parallel-size",
        "-pp",
        "--distributed-executor-backend",
    ],
    "SpeculativeConfig": ["--speculative-config"],
    "StructuredOutputsConfig": ["--structured-outputs-config"],
    "LoRAConfig": ["--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"],
    "CompilationConfig": ["-O", "--compilation-config"],
}


def serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("no serve subcommand")


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def test_flags_and_defaults_unchanged():
    args = vars(build_parser().parse_args(["serve"]))
    args.pop("command")
    assert args == DEFAULTS


@pytest.mark.parametrize("action", flag_actions(serve_parser()), ids=lambda a: (a.option_strings or [a.dest])[-1])
def test_every_flag_has_one_line_of_help_and_its_default(action):
    parser = serve_parser()
    assert action.help and "\n" not in action.help, action.dest
    shown = parser._get_formatter()._expand_help(action)  # the text --help prints, default included
    assert "default" in shown, f"{action.option_strings or action.dest}: {shown!r}"


def test_flags_are_grouped_as_vllm_groups_them():
    parser = serve_parser()
    groups = {g.title: g for g in parser._action_groups}
    for title, flags in GROUPS.items():
        assert title in groups, title
        names = {s for a in groups[title]._group_actions for s in (a.option_strings or [a.dest])}
        assert set(flags) <= names, (title, set(flags) - names)
    grouped = {id(a) for t in GROUPS for a in groups[t]._group_actions}
    loose = [a.option_strings or [a.dest] for a in flag_actions(parser) if id(a) not in grouped]
    assert not loose, f"flags outside vLLM's groups: {loose}"


def test_help_text_shows_groups_and_defaults():
    text = serve_parser().format_help()
    for title in GROUPS:
        assert f"\n{title}:" in text, title
    assert "(default: 128)" in text and "(default: 127.0.0.1)" in text and "(default: 16)" in text
    assert "(default: None)" not in text  # None defaults say what they mean instead
    assert "VLSERVE_CPU_KVCACHE_SPACE" in text


def test_kv_cache_memory_is_accepted_for_kv_cache_memory_bytes():
    """`--kv-cache-memory` (the issue's spelling) is a unique prefix argparse resolves to --kv-cache-memory-bytes."""
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "1048576"])
    assert args.kv_cache_memory_bytes == 1048576
