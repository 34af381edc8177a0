"""What the GPU check runs at: the sizes on CUDA (`SIZES`) and in a dry run on CPU (`DRY`: tiny, the
same code paths in seconds), the compilation levels of the throughput steps, and the test selections."""

from __future__ import annotations

CPU_KERNEL_TESTS = (
    "test_kernel_cpu_linear",
    "test_cpu_linear_pre_add",
    "test_kernel_cpu_decode",
    "test_lora_cpu_kernel",
    "test_quant_linear",
)
# Sizes on CUDA and in a dry run (CPU, tiny).
SIZES = {
    "model": dict(hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=4, intermediate_size=6144),
    "dtype": "bfloat16",
    "num_prompts": 256,
    "input_len": 128,
    "output_len": 128,
    "single_len": 256,
    "race": dict(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, max_position_embeddings=4096
    ),  # holds race_prompt + 64
    "race_prompt": 3000,
    "race_chunk": 256,
    "race_repeats": 3,
    # the packed CPU kernels' tests (~1,750 of tests/kernels' ~2,400) run the same on any machine: left out here,
    # they took the whole 300 s of the second GPU run before the CUDA tests after them started
    "pytest": [
        "tests/kernels",
        "tests/worker",
        "tests/engine/test_async_scheduling.py",
        "tests/lora/test_lora_graphs.py",
        "tests/bench/test_gpu_report.py",
        *(f"--ignore=tests/kernels/{f}.py" for f in CPU_KERNEL_TESTS),
    ],
    "mm_cache": dict(num_requests=32, num_images=4, image_size=448, vision_depth=8, vision_width=512, output_len=8),
    "eagle": dict(num_prompts=16, batch_sizes=(1, 16)),
    "demo_tokens": 128,
    # one HF-parity test per family: the engines at -O2 (compiled, CUDA graphs), the oracle on the same GPU
    "parity": [
        f"tests/{t}"
        for t in (
            "engine/test_text_parity.py::test_parity_batch_of_varied_lengths",
            "models/test_gemma3_text.py::test_greedy_matches_hf",
            "multimodal/test_mm_engine_parity.py::test_batch_parity_with_hf",
            "multimodal/test_llava.py::test_greedy_parity_with_hf",
            "multimodal/test_perception_lm.py::test_generate_and_chat_parity_with_hf",
            "multimodal/test_audio_parity.py::test_generate_audios_and_dicts_match_hf",
            "multimodal/test_qwen3_vl.py::test_generate_and_chat_parity_with_hf",
            "multimodal/test_internvl.py::test_generate_and_chat_parity_with_hf",
            "multimodal/test_mistral3.py::test_generate_and_chat_parity_with_hf",
            "multimodal/test_gemma3_vlm_engine.py::test_server_image_url_parity_with_hf",
            "multimodal/test_qwen3_vl_moe_engine.py::test_server_image_url_parity_with_hf",
        )
    ],
}
DRY = {
    "model": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "dtype": "float32",
    "num_prompts": 4,
    "input_len": 8,
    "output_len": 8,
    "single_len": 16,
    "race": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "race_prompt": 120,
    "race_chunk": 16,
    "race_repeats": 1,
    "pytest": ["tests/worker/test_compilation.py", "-k", "config or serve_flags or decode_buffers"],
    "mm_cache": dict(num_requests=3, num_images=2, image_size=56, vision_depth=1, vision_width=32, output_len=2),
    "eagle": dict(num_prompts=2, batch_sizes=(1,)),
    "demo_tokens": 8,
    "parity": ["tests/engine/test_text_parity.py::test_parity_batch_of_varied_lengths"],
}
LEVELS = {
    "throughput_O0": (0, False),
    "throughput_O1": (1, False),
    "throughput_O2": (2, False),
    "throughput_async": (2, True),
}


def sizes(cfg: dict) -> dict:
    """The size table of this run: `DRY` for a dry run, else `SIZES`."""
    return DRY if cfg["dry_run"] else SIZES
