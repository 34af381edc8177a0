"""Run a function in every rank of a CPU tensor-parallel group (spawned processes, gloo) and collect the results;
plus the rank-side step used by the model tests: load a checkpoint with `load_model` and run a few paged steps.

`run_tensor_parallel(fn, world_size, *args)` spawns `world_size` processes; each sets one intra-op thread, joins
the group at a free loopback port, calls `fn(*args)` and saves its return value (a picklable tree of tensors and
plain values). `fn` must be importable by name (a module-level function). A rank's exception fails the call with
that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch

from vlserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel, tp_rank, tp_size


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        torch.save(fn(*args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_tensor_parallel()
    # The result is saved and the group left: end the process without the interpreter's teardown, where gloo's
    # threads, still running after destroy_process_group, abort it now and then ("terminate called without an active
    # exception", SIGABRT, in about 1 of 6 two-rank tower runs on the AVX-512 EPYC).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_tensor_parallel(fn, world_size: int, *args) -> list:
    """`[fn(*args) on rank 0, ..., on rank world_size - 1]`, each run in its own spawned rank process."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vlserve-tp-") as out_dir:
        mp.spawn(_rank_entry, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]


# ---- the rank-side model step -------------------------------------------------------------------------------------


def _image_inputs(model, hf_config, num_tokens: int) -> tuple[dict, dict]:
    """A random 1-image step for a Qwen2-VL model: ({seq: inputs_embeds [T, H]}, {seq: positions [3, T]})."""
    vision = hf_config.vision_config
    grid = (1, 4, 4)
    row = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(grid[0] * grid[1] * grid[2], row, generator=torch.Generator().manual_seed(7))
    image = model.embed_multimodal("image", {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid])})
    ids = torch.arange(num_tokens) * 7 % hf_config.text_config.vocab_size
    embeds = model.get_input_embeddings(ids).clone()  # [T, H]
    embeds[2 : 2 + image.shape[0]] = image
    t = torch.arange(num_tokens)
    positions = torch.stack([t, t // 2, t % 3 + t // 3])  # [3, T]: distinct per M-RoPE axis
    return {"img": embeds}, {"img": positions}


def paged_step_logits(
    model_dir: str,
    prompts: list[list[int]],
    decode_tokens: list[int],
    compile_cache_dir: str | None = None,
    image: bool = False,
    compile_rank: int | None = None,
) -> dict:
    """Load `model_dir` (float32, CPU) in this process's TP rank and run, over a paged KV cache, one batched prefill
    of `prompts` then one decode step per entry of `decode_tokens` (that token appended to every prompt).

    `compile_cache_dir` runs the decoder compiled (-O1, inductor cache there), on every rank or only on rank
    `compile_rank` (the others eager: same collectives in the same order, half the compile work on a small
    machine). `image` (Qwen2-VL models) adds a
    sequence whose prefill is `inputs_embeds` with an image's embeddings and `[3, T]` M-RoPE positions.
    Returns {"logits": [per step: {seq: [q, V]}], "read_shapes": {checkpoint name: shape this rank read}}.
    """
    from transformers import AutoConfig

    from tests.support.paged_runner import PagedRunner
    from vlserve.config import CompilationConfig
    from vlserve.models import iter_safetensors_weights, load_model
    from vlserve.worker.compiled_forward import ModelForward

    cfg = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, cfg, torch.float32, "cpu")
    shard_of = model.checkpoint_shard if tp_size() > 1 else None
    read_shapes = {n: tuple(t.shape) for n, t in iter_safetensors_weights(model_dir, shard_of)}
    forward = None
    if compile_cache_dir is not None and compile_rank in (None, tp_rank()):
        forward = ModelForward(model, torch.device("cpu"), CompilationConfig(level=1, cache_dir=compile_cache_dir))
    runner = PagedRunner(model, cfg, block_size=4, forward=forward)
    steps = [runner.step([(f"s{i}", p) for i, p in enumerate(prompts)])]
    if image:
        embeds, positions = _image_inputs(model, cfg, 12)
        steps.append(runner.step([("img", [0] * 12)], positions=positions, inputs_embeds=embeds))
    for tok in decode_tokens:
        items = [(f"s{i}", [tok]) for i in range(len(prompts))]
        steps.append(runner.step(items))
    return {"logits": steps, "read_shapes": read_shapes}


def paged_step_logits_of_cases(
    cases: dict[str, tuple[str, bool]], prompts: list[list[int]], decode_tokens: list[int]
) -> dict:
    """`paged_step_logits` for each `{name: (model_dir, image)}` (several checkpoints in one spawn)."""
    return {name: paged_step_logits(d, prompts, decode_tokens, image=image) for name, (d, image) in cases.items()}
