"""`kv_cache_dtype="fp8"` end to end: the KV cache tensors are float8_e4m3fn, the same memory budget holds 2x the blocks
of a bf16 cache (4x of float32), per-layer k_scale / v_scale load from the checkpoint, greedy tokens stay close to
the "auto" (model dtype) cache's, prefix caching and n-gram spec decode run on it, and the flag is in
`vlserve serve --help`. The kernels' own fp8 checks are in tests/kernels/test_kv_fp8.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from vlserve import LLM, SamplingParams
from vlserve.kernels import get_attention_backend
from vlserve.kernels.kv_quant import FP8_KV_DTYPE

BUDGET = 2 << 20  # KV bytes: 256 float32 blocks of the checkpoint below (2 layers x K,V x 2 heads x 16 x 16 tokens)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MIN_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Qwen2. initializer_range 0.1: varied greedy outputs that repeat a token now and then (0.05
    repeats one token throughout; the default 0.2 makes attention so sharp that e4m3's 3 mantissa bits flip ~10-20%
    of the teacher-forced argmaxes)."""
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(
        str(tmp_path_factory.mktemp("qwen2_fp8kv")), arch="qwen2", num_layers=2, initializer_range=0.1
    )


def _llm(model, **kw):
    kw = {"dtype": "float32", "kv_cache_memory_bytes": BUDGET, "max_model_len": 512, "seed": 0, **kw}
    return LLM(model, **kw)


def _greedy(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompts(n=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 600, (4 + 7 * i,), generator=g).tolist() for i in range(n)]


def _tokens(llm, prompts, n=24):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(n), use_tqdm=False)]


def test_same_budget_holds_2x_bf16_and_4x_float32_blocks(ckpt):
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8_e4m3")):
        llm = _llm(ckpt, dtype=dtype, kv_cache_dtype=kv)
        runner = llm.engine.runner
        k_cache = runner.kv_caches[0][0]
        assert k_cache.dtype == (FP8_KV_DTYPE if kv != "auto" else getattr(torch, dtype))
        # the torch decode path's scratch buffer is in the cache dtype; the Triton backend (CUDA) has none
        torch_path = get_attention_backend(runner.device) == "torch"
        assert (runner.attn_workspace.dtype == k_cache.dtype) if torch_path else runner.attn_workspace is None
        assert runner.bytes_per_block() == 2 * 2 * k_cache[0].numel() * k_cache.element_size()  # 2 layers x K, V
        blocks[dtype, kv] = llm.engine.executor.num_blocks
    assert blocks["float32", "auto"] == BUDGET // (2 * 2 * 16 * 2 * 16 * 4) == 256
    assert blocks["float32", "fp8"] == 4 * blocks["float32", "auto"]
    assert blocks["float32", "fp8"] == 2 * blocks["bfloat16", "auto"] == blocks["bfloat16", "fp8_e4m3"]


def test_fp8_greedy_tokens_agree_with_auto(ckpt, capsys):
    # A random tiny model is chaotic: one flipped argmax changes the rest of a free-running continuation, so the
    # asserted figure is teacher-forced: at each position of the "auto" run's greedy output, the fp8 run's next
    # token given that same prefix (the free-running figure is printed too)
    prompts = _prompts()
    want = _tokens(_llm(ckpt), prompts)
    fp8 = _llm(ckpt, kv_cache_dtype="fp8")
    got = _tokens(fp8, prompts)
    total = sum(len(w) for w in want)
    free = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    prefixes = [p + w[:t] for p, w in zip(prompts, want) for t in range(len(w))]
    forced = sum(a == b for a, b in zip(_tokens(fp8, prefixes, 1), ([t] for w in want for t in w)))
    with capsys.disabled():
        print(
            f"\n[fp8 KV] greedy agreement with the float32 cache over {len(prompts)} prompts: teacher-forced "
            f"{forced}/{total} = {forced / total:.1%}, free-running {free}/{total} = {free / total:.1%}"
        )
    assert forced / total >= MIN_AGREEMENT


def test_fp8_with_prefix_caching_ngram_spec_decode_chunks_and_preemption(ckpt):
    # they move block ids, not bytes: the fp8 tokens stay those of a plain fp8 run
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 600, (40,), generator=g).tolist()  # 2 full blocks shared by every prompt
    prompts = [shared + torch.randint(3, 600, (6,), generator=g).tolist() * 3 for _ in range(3)]
    want = _tokens(_llm(ckpt, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts)
    llm = _llm(ckpt, kv_cache_dtype="fp8", speculative_config=NGRAM, max_num_batched_tokens=32)  # chunked prefill
    assert _tokens(llm, prompts[:1]) == want[:1]
    assert _tokens(llm, prompts[1:]) == want[1:]  # the shared blocks come from the cache
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] >= 32
    assert 0 < m["vlserve:spec_decode_num_accepted_tokens_total"] <= m["vlserve:spec_decode_num_draft_tokens_total"]
    llm.check_integrity()
    # 8 usable blocks where 3 requests of 82 tokens want 6 each: preempted and recomputed
    small = _llm(ckpt, kv_cache_dtype="fp8", num_kv_blocks=9, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _tokens(small, prompts) == want
    assert small.get_metrics()["vlserve:num_preemptions_total"] > 0
    small.check_integrity()


def _with_scales(src: str, dst: str, scales: dict[str, torch.Tensor]) -> str:
    """A copy of checkpoint `src` with extra tensors in its safetensors file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file({**load_file(path), **scales}, path, metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales_load_and_run(ckpt, tmp_path):
    from vlserve.models.loader import load_model

    # compressed-tensors' kv_cache_scheme names; powers of two, so that x / scale * scale is x again in e4m3 (but
    # for the values the scale moves across the subnormal boundary)
    scales = [(0.25, 0.5), (0.5, 0.125)]
    ct = {
        f"model.layers.{i}.self_attn.{n}": torch.tensor(s)
        for i, pair in enumerate(scales)
        for n, s in zip(("k_scale", "v_scale"), pair)
    }
    plain = _llm(ckpt, kv_cache_dtype="fp8")
    want = _tokens(plain, _prompts(3), 8)
    llm = _llm(_with_scales(ckpt, str(tmp_path / "ct"), ct), kv_cache_dtype="fp8")
    attn = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == scales
    assert _tokens(llm, _prompts(3), 8) == want
    # layer 0 got the same K/V in both runs (later layers' differ a little), written divided by its scales: other
    # bytes, the same values once dequantized
    (k_scale, v_scale), scaled, unscaled = scales[0], llm.engine.runner.kv_caches[0], plain.engine.runner.kv_caches[0]
    assert not torch.equal(scaled[0].view(torch.uint8), unscaled[0].view(torch.uint8))
    torch.testing.assert_close(scaled[0].float() * k_scale, unscaled[0].float(), atol=2**-9, rtol=0)
    torch.testing.assert_close(scaled[1].float() * v_scale, unscaled[1].float(), atol=2**-9, rtol=0)
    # vLLM's older names: the k/v projections' output_scale (shape [1]); not per-tensor -> refused by name
    proj = {f"model.layers.{i}.self_attn.{p}_proj.output_scale": torch.tensor([0.5]) for i in range(2) for p in "kv"}
    model = load_model(_with_scales(ckpt, str(tmp_path / "proj"), proj), _config(ckpt), torch.float32, "cpu")
    assert all(layer.self_attn.k_scale == layer.self_attn.v_scale == 0.5 for layer in model.model.layers)
    bad = {"model.layers.0.self_attn.k_scale": torch.ones(2)}
    with pytest.raises(ValueError, match="per tensor"):
        load_model(_with_scales(ckpt, str(tmp_path / "bad"), bad), _config(ckpt), torch.float32, "cpu")


def _config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def test_unknown_kv_cache_dtype_is_refused_and_the_flag_is_in_serve_help(capsys):
    from vlserve.cli import build_parser, main, serve_config_from_args

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        LLM("unused", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    flag_help = help_text[help_text.rindex("--kv-cache-dtype {auto,fp8,fp8_e4m3}") :]  # its line, not the usage
    flag_help = flag_help[: flag_help.index(" --", 3)]
    assert "float8_e4m3fn" in flag_help and "(default: auto)" in flag_help
    engine_args, _ = serve_config_from_args(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    assert engine_args.kv_cache_dtype == "fp8"
