"""Quantized checkpoints, on copies of a tiny Qwen2 packed in each format (`tests.support.quant_checkpoints`):

- weight-only schemes (compressed-tensors W4A16 / W8A16 sym, asym, channel, act order; GPTQ 4 / 8 bit, desc_act;
  AWQ) give the logits of transformers running the dequantized weights, in float32, and greedy tokens equal to its
  `generate`;
- compressed-tensors checkpoints that transformers loads itself (through the compressed-tensors package) give its
  logits (weight-only, FP8 with FP8 activations) or its top-1 token (W8A8 INT8: vLLM's absmax / 127 activation
  scale vs compressed-tensors' absmax / 127.5);
- tensor parallel 2 gives the unsharded logits; quantized Qwen2-VL runs an image; prefix caching and n-gram drafts
  leave greedy output unchanged;
- bad checkpoints and requests are ValueErrors that name the method or the tensor.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.hf_generate import hf_greedy_ignoring_eos
from tests.support.paged_runner import PagedRunner
from tests.support.quant_checkpoints import quantize_checkpoint
from tests.support.tensor_parallel import paged_step_logits, paged_step_logits_of_cases, run_tensor_parallel
from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.models import load_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 600, 2, 8, 31]]
DECODES = [13, 688]
WEIGHT_ONLY = [
    "ct-w4a16",
    "ct-w4a16-asym",
    "ct-w4a16-actorder",
    "ct-w4a16-channel",
    "ct-w8a16",
    "gptq-4",
    "gptq-8",
    "gptq-4-actorder",
    "awq",
]
HF_LOADS = ["ct-w4a16", "ct-w4a16-channel", "ct-w8a16", "ct-fp8", "ct-fp8-tensor", "ct-fp8-block"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_text_checkpoint(
        str(tmp_path_factory.mktemp("qbase")),
        arch="qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def quantized(base_dir, tmp_path_factory):
    """scheme -> (quantized dir, dequantized float dir), built on first use."""
    made: dict[str, tuple[str, str]] = {}

    def get(scheme: str) -> tuple[str, str]:
        if scheme not in made:
            root = tmp_path_factory.mktemp(scheme)
            made[scheme] = (
                quantize_checkpoint(base_dir, str(root / "q"), scheme, dequantized_dst=str(root / "f")),
                str(root / "f"),
            )
        return made[scheme]

    return get


def _hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _our_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    cfg = AutoConfig.from_pretrained(model_dir)
    return PagedRunner(load_model(model_dir, cfg, torch.float32, "cpu"), cfg).step([("a", ids)])["a"]


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_weight_only_matches_transformers_on_dequantized_weights(quantized, scheme):
    """Prefill + decode logits over the paged KV cache equal transformers' on the dequantized float checkpoint."""
    qdir, fdir = quantized(scheme)
    got = paged_step_logits(qdir, PROMPTS, DECODES)["logits"]
    for i, prompt in enumerate(PROMPTS):
        ids = prompt + DECODES
        want = _hf_logits(fdir, ids)
        steps = [got[0][f"s{i}"]] + [step[f"s{i}"] for step in got[1:]]
        torch.testing.assert_close(torch.cat(steps), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", HF_LOADS)
def test_matches_transformers_loading_compressed_tensors(quantized, scheme):
    """transformers + compressed-tensors load the same quantized directory: same logits (FP8 quantizes the
    activations in both)."""
    pytest.importorskip("compressed_tensors")
    qdir, _ = quantized(scheme)
    ids = PROMPTS[0] + DECODES
    torch.testing.assert_close(_our_logits(qdir, ids), _hf_logits(qdir, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["ct-w8a8", "ct-fp8", "ct-fp8-block"])
def test_activation_quantized_top1_agreement(quantized, scheme, capsys):
    """Dynamic INT8 / FP8 activations: the top-1 token at every position agrees with transformers' >= 98%."""
    pytest.importorskip("compressed_tensors")
    qdir, _ = quantized(scheme)
    g = torch.Generator().manual_seed(1)
    agree = total = 0
    worst = 0.0
    for _ in range(6):
        ids = torch.randint(3, 689, (24,), generator=g).tolist()
        ours, ref = _our_logits(qdir, ids), _hf_logits(qdir, ids)
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item())
    with capsys.disabled():
        print(f"\n{scheme}: top-1 agreement {agree}/{total}, max |logprob diff| {worst:.4f}")
    assert agree / total >= 0.98


@pytest.mark.parametrize("scheme, on_torch", [("ct-w8a8", True), ("ct-fp8", True), ("ct-w4a16-asym", False)])
def test_activation_quantization_keeps_float32_norms_on_torch(quantized, scheme, on_torch):
    """The C++ RMSNorm's summation order can move a float32 activation by its last bit, and a quantized activation
    to another grid value than the format's library computes: those models' norms stay on torch's ops."""
    from vlserve.models.layers import RMSNorm

    model = _load(quantized(scheme)[0])
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(n.float32_on_torch is on_torch for n in norms)


@pytest.mark.parametrize("scheme", ["gptq-4-actorder", "awq", "ct-w4a16-asym"])
def test_llm_greedy_equals_transformers_generate(quantized, scheme):
    """`LLM.generate` on the quantized checkpoint: greedy tokens equal HF generate on the dequantized weights."""
    from vlserve import LLM, SamplingParams

    qdir, fdir = quantized(scheme)
    hf = AutoModelForCausalLM.from_pretrained(fdir, dtype=torch.float32)
    llm = LLM(qdir, dtype="float32", num_kv_blocks=64)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    for prompt, out in zip(PROMPTS, outs):
        want = hf_greedy_ignoring_eos(hf, {"input_ids": torch.tensor([prompt])}, 12)[0, len(prompt) :].tolist()
        assert list(out.outputs[0].token_ids) == want


def test_prefix_cache_and_ngram_drafts_leave_output_unchanged(quantized):
    from vlserve import LLM, SamplingParams

    qdir, _ = quantized("gptq-4")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]}, {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = LLM(qdir, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False).generate(prompts, params)
    spec = LLM(
        qdir, dtype="float32", num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    ).generate(prompts * 2, params)
    want = [list(o.outputs[0].token_ids) for o in plain]
    assert [list(o.outputs[0].token_ids) for o in spec] == want * 2


def test_eagle_head_stays_float_on_a_quantized_target(quantized, tmp_path):
    """An EAGLE head (float, mimicking the float model's last layer) drafting for a GPTQ target: greedy output
    equals the target's own."""
    from vlserve import LLM, SamplingParams
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    qdir, fdir = quantized("gptq-4")
    head = build_eagle_checkpoint(str(tmp_path / "eagle"), fdir, init="mimic")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(qdir, dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    spec = LLM(
        qdir,
        dtype="float32",
        num_kv_blocks=64,
        speculative_config={"method": "eagle", "num_speculative_tokens": 3, "model": head},
    )
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]


def test_two_ranks_match_unsharded(quantized):
    """TP=2: packed weights, group scales, packed zero points and g_idx are split on the right dims: weight-only
    logits equal the unsharded ones. With dynamic activation quantization each rank of a row-parallel layer scales
    its own half of a token (as vLLM does), so those are held to the top-1 token."""
    exact = ["ct-w4a16-asym", "ct-w4a16-channel", "gptq-8", "awq"]
    schemes = exact + ["ct-w8a8", "ct-fp8", "ct-fp8-block"]
    cases = {s: (quantized(s)[0], False) for s in schemes}
    ranks = run_tensor_parallel(paged_step_logits_of_cases, 2, cases, PROMPTS, DECODES)
    for name, (model_dir, _) in cases.items():
        want = paged_step_logits(model_dir, PROMPTS, DECODES)["logits"]
        agree = total = 0
        for rank in ranks:
            for got_step, want_step in zip(rank[name]["logits"], want, strict=True):
                for seq in want_step:
                    if name in exact:
                        torch.testing.assert_close(
                            got_step[seq], want_step[seq], atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
                        )
                    agree += int((got_step[seq].argmax(-1) == want_step[seq].argmax(-1)).sum())
                    total += got_step[seq].shape[0]
        assert agree / total >= (1.0 if name in exact else 0.85), f"{name}: top-1 {agree}/{total}"


def test_quantized_qwen2_vl_runs_an_image(tmp_path):
    """A Qwen2-VL whose language model is W4A16: the image prefill and decodes equal the dequantized model's."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    base = build_qwen2_vl_checkpoint(
        str(tmp_path / "vl"), hidden_size=128, intermediate_size=256, mrope_section=(4, 6, 6)
    )
    qdir = quantize_checkpoint(base, str(tmp_path / "q"), "gptq-4", dequantized_dst=str(tmp_path / "f"))
    got = paged_step_logits(qdir, PROMPTS, DECODES, image=True)["logits"]
    want = paged_step_logits(str(tmp_path / "f"), PROMPTS, DECODES, image=True)["logits"]
    assert "img" in got[1]
    for got_step, want_step in zip(got, want, strict=True):
        for seq in want_step:
            torch.testing.assert_close(got_step[seq], want_step[seq], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_audio"])
def test_other_families_load_quantized_language_models(tmp_path, family):
    """LLaVA-1.5 / -NeXT (CLIP tower, whose layers are named like a decoder's) and Qwen2-Audio (a Whisper tower):
    only the language model is quantized, found under its own prefix, and its logits equal the dequantized
    model's."""
    if family == "qwen2_audio":
        from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

        base = build_qwen2_audio_checkpoint(str(tmp_path / "b"))
    else:
        from vlserve.demo.llava_checkpoints import build_llava_checkpoint

        base = build_llava_checkpoint(str(tmp_path / "b"), variant=family)
    qdir = quantize_checkpoint(base, str(tmp_path / "q"), "gptq-4", group_size=32, dequantized_dst=str(tmp_path / "f"))
    model = _load(qdir)
    assert sum(getattr(m, "quant_scheme", None) is not None for m in model.modules()) == 2 * 4  # 2 layers x 4
    got = paged_step_logits(qdir, PROMPTS, DECODES)["logits"]
    want = paged_step_logits(str(tmp_path / "f"), PROMPTS, DECODES)["logits"]
    for got_step, want_step in zip(got, want, strict=True):
        for seq in want_step:
            torch.testing.assert_close(got_step[seq], want_step[seq], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------- bad input


def _edit_config(model_dir: str, fn) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    fn(cfg["quantization_config"])
    with open(path, "w") as f:
        json.dump(cfg, f)


def _edit_tensors(model_dir: str, fn) -> None:
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load(model_dir: str, quantization: str | None = None):
    return load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu", quantization)


def test_unknown_method_and_mismatch_are_value_errors(quantized, tmp_path):
    import shutil

    qdir = shutil.copytree(quantized("gptq-4")[0], tmp_path / "m")
    with pytest.raises(ValueError, match="quantization='awq' does not match .* 'gptq'"):
        _load(str(qdir), "awq")
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not supported"):
        _load(str(qdir), "bitsandbytes")
    _edit_config(str(qdir), lambda q: q.update(quant_method="hqq"))
    with pytest.raises(ValueError, match="quant_method 'hqq' is not supported"):
        _load(str(qdir))


def test_unquantized_checkpoint_with_quantization_flag(base_dir):
    with pytest.raises(ValueError, match="has no quantization_config"):
        _load(base_dir, "gptq")


@pytest.mark.parametrize(
    "scheme,edit,match",
    [
        ("gptq-4", lambda t: t.pop("model.layers.0.self_attn.q_proj.scales"), "missing .*q_proj.scales"),
        (
            "gptq-4",
            lambda t: t.update({"model.layers.1.mlp.down_proj.qzeros": torch.zeros(3, 16, dtype=torch.int32)}),
            "down_proj.qzeros.* has shape",
        ),
        (
            "ct-w4a16",
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(256, 3)}),
            "up_proj.weight_scale.* has shape",
        ),
        ("awq", lambda t: t.pop("model.layers.0.self_attn.o_proj.qzeros"), "missing .*o_proj.qzeros"),
    ],
)
def test_missing_or_misshaped_tensor_names_it(quantized, tmp_path, scheme, edit, match):
    import shutil

    qdir = str(shutil.copytree(quantized(scheme)[0], tmp_path / "m"))
    _edit_tensors(qdir, edit)
    with pytest.raises(ValueError, match=match):
        _load(qdir)


def test_group_size_that_does_not_divide_is_a_value_error(quantized, tmp_path):
    import shutil

    qdir = str(shutil.copytree(quantized("gptq-4")[0], tmp_path / "m"))
    _edit_config(qdir, lambda q: q.update(group_size=48))
    with pytest.raises(ValueError, match="gptq group_size: .* input size 128 is not divisible by 48"):
        _load(qdir)


def test_unsupported_compressed_tensors_scheme_names_the_field(quantized, tmp_path):
    import shutil

    qdir = str(shutil.copytree(quantized("ct-w8a8")[0], tmp_path / "m"))
    _edit_config(qdir, lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False))
    with pytest.raises(ValueError, match="config_groups.group_0.input_activations: only dynamic"):
        _load(qdir)


def test_quantized_lm_head_is_refused_by_name(quantized, tmp_path):
    import shutil

    qdir = str(shutil.copytree(quantized("gptq-4")[0], tmp_path / "m"))

    def quantize_head(t):
        t["lm_head.qweight"] = torch.zeros(16, 689, dtype=torch.int32)

    _edit_tensors(qdir, quantize_head)
    with pytest.raises(ValueError, match="runs unquantized only .*'lm_head'"):
        _load(qdir)


def test_tensor_parallel_split_off_a_group_boundary_is_a_value_error(base_dir, tmp_path):
    """Groups of 128 input columns cannot be split where a rank's half of o_proj's 128 columns ends."""
    from tests.models.test_tensor_parallel import fake_rank

    qdir = quantize_checkpoint(base_dir, str(tmp_path / "q"), "gptq-4", group_size=128)
    with (
        fake_rank(0, 2),
        pytest.raises(ValueError, match="o_proj: gptq group_size: .*input size 64 is not divisible by 128"),
    ):
        _load(qdir)
