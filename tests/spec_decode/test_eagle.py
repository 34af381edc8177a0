"""EAGLE / EAGLE-3 drafting through the engine: greedy output identical with the draft on and off (text and
Qwen2-VL with images, chunked prefill, preemption), an exactly-right head accepts every draft, the training path
matches the serving path, and `train-eagle` produces a head that beats an untrained one on held-out prompts."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.support.eagle_checkpoints import scale_attention_output, zero_attention_output
from vlserve import LLM, SamplingParams
from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

K = 3


def _spec(method, path, k=K):
    return {"method": method, "num_speculative_tokens": k, "model": path}


def _greedy(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompts(n: int, seed: int = 0, vocab: int = 600) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + i % 7,), generator=g).tolist() * (1 + i % 3) for i in range(n)]


@pytest.fixture(scope="module")
def text_target(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("eagle_qwen2")), arch="qwen2", num_layers=1)


@pytest.fixture(scope="module")
def heads(text_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_heads")
    return {
        # a copy of the target's layer: most drafts right, some wrong (exercises partial acceptance)
        "eagle-mimic": ("eagle", build_eagle_checkpoint(str(root / "mimic"), text_target, "eagle", "mimic")),
        "eagle3-random": ("eagle3", build_eagle_checkpoint(str(root / "e3"), text_target, "eagle3", "random")),
        "eagle3-reduced-vocab": ("eagle3", _reduced_vocab_head(str(root / "e3v"), text_target)),
    }


def _reduced_vocab_head(out, target):
    """An EAGLE-3 head over every other token of the target vocabulary (d2t mapping)."""
    from safetensors.torch import load_file, save_file

    build_eagle_checkpoint(out, target, "eagle3", "random", draft_vocab_size=None)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    vd = cfg["vocab_size"] // 2
    cfg["draft_vocab_size"] = vd
    t = load_file(os.path.join(out, "model.safetensors"))
    t["lm_head.weight"] = torch.randn(vd, cfg["hidden_size"]) * 0.5
    t["d2t"] = torch.arange(vd, dtype=torch.long)  # draft id i -> target id 2i
    save_file(t, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


ENGINE_CONFIGS = [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"num_kv_blocks": 10, "max_num_batched_tokens": 64},  # forced preemption
]


@pytest.mark.parametrize("engine_kwargs", ENGINE_CONFIGS, ids=["plain", "chunked", "preempt"])
@pytest.mark.parametrize("head", ["eagle-mimic", "eagle3-random", "eagle3-reduced-vocab"])
def test_eagle_greedy_equals_plain(text_target, heads, head, engine_kwargs):
    method, path = heads[head]
    prompts = _prompts(6)
    kw = {"dtype": "float32", "num_kv_blocks": 128, **engine_kwargs}
    base = LLM(text_target, **kw).generate(prompts, _greedy(), use_tqdm=False)
    spec_llm = LLM(text_target, speculative_config=_spec(method, path), **kw)
    spec = spec_llm.generate(prompts, _greedy(), use_tqdm=False)
    for i, (b, s) in enumerate(zip(base, spec)):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}"
    m = spec_llm.get_metrics()
    assert m["vlserve:spec_decode_num_drafts_total"] > 0
    assert m["vlserve:spec_decode_num_draft_tokens_total"] >= m["vlserve:spec_decode_num_drafts_total"]
    if head == "eagle-mimic":  # partial acceptance: some drafts accepted, some rejected
        assert 0 < m["vlserve:spec_decode_num_accepted_tokens_total"] < m["vlserve:spec_decode_num_draft_tokens_total"]
    assert m["vlserve:generation_tokens_total"] == 24 * len(prompts)
    if engine_kwargs.get("num_kv_blocks", 128) < 20:
        assert m["vlserve:num_preemptions_total"] > 0
    spec_llm.check_integrity()


def test_exact_head_accepts_every_draft(text_target, tmp_path):
    """A target whose attention output is zero makes each hidden state a function of its own token; a head whose
    fc passes the next token's embedding into a copy of that layer then IS the target: every draft accepted."""
    target = str(tmp_path / "target")
    shutil.copytree(text_target, target)
    zero_attention_output(target)
    head = build_eagle_checkpoint(str(tmp_path / "head"), target, "eagle", "mimic")
    prompts = _prompts(5, seed=3)
    base = LLM(target, dtype="float32", num_kv_blocks=64).generate(prompts, _greedy(), use_tqdm=False)
    llm = LLM(
        target,
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        speculative_config=_spec("eagle", head, k=4),
    )
    out = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    m = llm.get_metrics()
    assert m["vlserve:spec_decode_num_draft_tokens_total"] > 50
    assert m["vlserve:spec_decode_num_accepted_tokens_total"] == m["vlserve:spec_decode_num_draft_tokens_total"]
    # up to k + 1 tokens per step: far fewer steps than tokens
    assert m["vlserve:spec_decode_num_drafts_total"] <= 24 * len(prompts) / 4


def test_eagle_sampling_seeded_and_stops(text_target, heads):
    method, path = heads["eagle-mimic"]
    llm = LLM(text_target, dtype="float32", num_kv_blocks=128, speculative_config=_spec(method, path))
    base = LLM(text_target, dtype="float32", num_kv_blocks=128)
    prompts = _prompts(4, seed=1)
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert a == b and all(len(t) == 16 for t in a)
    for sp in (_greedy(7), SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[prompts[0][2]])):
        x = [o.outputs[0] for o in base.generate(prompts, sp, use_tqdm=False)]
        y = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert [o.token_ids for o in x] == [o.token_ids for o in y]
        assert [o.finish_reason for o in x] == [o.finish_reason for o in y]
    llm.check_integrity()


def test_eagle_near_max_model_len(text_target, heads):
    """Drafts stop at max_model_len (no position past the RoPE table, no KV slot past the block table)."""
    method, path = heads["eagle-mimic"]
    prompts = _prompts(3, seed=2)
    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    kw = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 40}
    base = LLM(text_target, **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(text_target, speculative_config=_spec(method, path, k=5), **kw)
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    llm.check_integrity()


# ---------------------------------------------------------------------------------------------------- Qwen2-VL


@pytest.fixture(scope="module")
def vl_target(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("eagle_vl")), num_layers=1)


@pytest.mark.parametrize("engine_kwargs", ENGINE_CONFIGS, ids=["plain", "chunked", "preempt"])
def test_eagle_on_vlm_with_images(vl_target, tmp_path_factory, engine_kwargs):
    head = build_eagle_checkpoint(str(tmp_path_factory.mktemp("vl_head") / "h"), vl_target, "eagle", "mimic")
    imgs = [[Image.fromarray(rand_image(56, 56, seed=s))] for s in range(3)]
    prompts = ["red red red square square square red red red square", "one two one two one two", "Describe."]
    kw = {"dtype": "float32", "num_kv_blocks": 128, **engine_kwargs}
    if "num_kv_blocks" in engine_kwargs:
        kw["num_kv_blocks"] = 8
    base = LLM(vl_target, **kw).generate(prompts, _greedy(16), images=imgs, use_tqdm=False)
    spec_llm = LLM(vl_target, speculative_config=_spec("eagle", head), **kw)
    spec = spec_llm.generate(prompts, _greedy(16), images=imgs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    m = spec_llm.get_metrics()
    assert 0 < m["vlserve:spec_decode_num_accepted_tokens_total"] < m["vlserve:spec_decode_num_draft_tokens_total"]
    if "num_kv_blocks" in engine_kwargs:
        assert m["vlserve:num_preemptions_total"] > 0
    spec_llm.check_integrity()


# ---------------------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_training_forward_matches_serving(text_target, method):
    """forward_train's unrolled step t at position p equals the paged path: pass 0 up to the last valid row P,
    then decode steps at P+1, P+2 fed with the previous output (EAGLE-3's training-time test attention)."""
    from transformers import AutoConfig

    from vlserve.kernels.metadata import AttentionMetadata
    from vlserve.models.loader import load_model
    from vlserve.spec_decode.eagle_checkpoint import init_eagle_weights
    from vlserve.spec_decode.eagle_heads import eagle_config_for
    from vlserve.spec_decode.eagle_model import EagleConfig, EagleDraftModel

    torch.manual_seed(0)
    hf = AutoConfig.from_pretrained(text_target)
    target = load_model(text_target, hf, torch.float32, torch.device("cpu"))
    draft = EagleDraftModel(EagleConfig.from_dict(eagle_config_for(hf, method)), hf)
    init_eagle_weights(draft, std=0.1)
    draft.rotary_emb.init_buffers()
    draft.attach_target(target)
    H = hf.hidden_size
    N, P, BS, NB = 20, 12, 4, 8
    emb, pos = torch.randn(N, H), torch.arange(N)
    hid = torch.randn(N, 3 * H if method == "eagle3" else H)
    outs = draft.forward_train(emb[None], hid[None], pos[None], num_steps=3)
    head_dim = H // hf.num_attention_heads
    kv = (torch.zeros(NB, BS, hf.num_key_value_heads, head_dim), torch.zeros(NB, BS, hf.num_key_value_heads, head_dim))
    bt = torch.arange(NB, dtype=torch.int32)[None]

    def md(start, n):
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + n),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            block_tables=bt,
            num_decodes=int(n == 1),
            max_query_len=n,
            max_seq_len=start + n,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[start + n],
        )

    with torch.no_grad():
        o0 = draft(emb[: P + 1], hid[: P + 1], pos[: P + 1], kv, md(0, P + 1), from_target=True)
        torch.testing.assert_close(o0, outs[0][0, : P + 1], atol=1e-5, rtol=1e-5)
        h = o0[P : P + 1]
        for t in (1, 2):
            q = P + t
            h = draft(emb[q : q + 1], h, pos[q : q + 1], kv, md(q, 1), from_target=False)
            torch.testing.assert_close(h[0], outs[t][0, q], atol=1e-5, rtol=1e-5)


def test_bad_eagle_checkpoints(text_target, heads, tmp_path):
    method, path = heads["eagle-mimic"]
    with pytest.raises(ValueError, match="does not match"):
        LLM(text_target, num_kv_blocks=16, speculative_config=_spec("eagle3", path))
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(text_target, num_kv_blocks=16, speculative_config=_spec("eagle", str(bad)))
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="EagleDraftModel"):
        LLM(text_target, num_kv_blocks=16, speculative_config=_spec("eagle", str(bad)))
    with pytest.raises(ValueError, match="config.json"):
        LLM(text_target, num_kv_blocks=16, speculative_config=_spec("eagle", str(tmp_path / "missing")))


# ---------------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """A 1-layer, 64-token target whose attention is damped (x0.05): the next token depends mostly, not only,
    on the current one, so a head can learn a lot of it in seconds; token-id prompts."""
    from vlserve.demo.checkpoints import build_text_checkpoint

    root = tmp_path_factory.mktemp("eagle_train")
    target = build_text_checkpoint(str(root / "target"), arch="qwen2", num_layers=1, vocab_size=64)
    scale_attention_output(target, 0.05)
    rng = np.random.default_rng(0)
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for _ in range(260):
            f.write(json.dumps({"prompt_token_ids": rng.integers(3, 64, rng.integers(4, 12)).tolist()}) + "\n")
    return target, str(data)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_train_eagle_beats_untrained(small_target, tmp_path, method, capsys):
    from training.train_eagle import build_parser, main, train_eagle

    target, data = small_target
    out = str(tmp_path / "head")
    argv = [
        "--target",
        target,
        "--data",
        data,
        "--out",
        out,
        "--method",
        method,
        "--gen-len",
        "32",
        "--ignore-eos",
        "--num-eval",
        "20",
        "--max-steps",
        "400",
        "--batch-size",
        "16",
        "--lr",
        "3e-3",
        "--label-temperature",
        "0",
        "--quiet",
    ]
    if method == "eagle3":
        argv += ["--draft-vocab-size", "48"]
    report = train_eagle(build_parser().parse_args(argv))
    ev = report["eval"]
    assert ev["identical_outputs"]
    assert ev["trained"]["acceptance_rate"] >= ev["untrained"]["acceptance_rate"] + 0.1, ev
    assert ev["trained"]["mean_accepted_length"] > ev["untrained"]["mean_accepted_length"], ev
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["architectures"] == ["EagleDraftModel"] and cfg["method"] == method
    assert os.path.isfile(os.path.join(out, "train_report.json"))
    # the written head serves
    llm = LLM(target, dtype="float32", num_kv_blocks=64, speculative_config=_spec(method, out))
    assert len(llm.generate([[5, 6, 7, 8]], _greedy(8), use_tqdm=False)[0].outputs[0].token_ids) == 8
    if method == "eagle":  # the CLI entry point parses and reports
        assert main(argv + ["--no-eval", "--max-steps", "2", "--out", str(tmp_path / "h2")]) == 0
        assert "trained on" in capsys.readouterr().out
