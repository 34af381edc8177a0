"""Tensor parallelism on the model side: 2 spawned CPU ranks (gloo) load the same tiny checkpoint with
`load_model`, run paged prefill + decode steps, and must give the unsharded model's logits; each rank reads only its
slices of the sharded tensors. Sizes checks, replicated towers and the EAGLE refusal run in-process with a faked
rank (building modules and loading issue no collective)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from tests.support.tensor_parallel import paged_step_logits, paged_step_logits_of_cases, run_tensor_parallel
from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.distributed import parallel_state
from vlserve.models import load_model
from vlserve.models.loader import safetensors_files

ATOL = RTOL = 1e-4
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 600, 2, 8, 31]]
DECODES = [13, 688]
# (arch, Hq, Hkv, tied): kv heads split / replicated, qkv bias (qwen2), q/k norm (qwen3) with q/k/v/o biases
# (attention_bias: o_proj's bias is added once after the all-reduce), tied and untied lm_head.
# The test tokenizer's vocab (689) is odd, so the vocab is padded to 690 over 2 ranks.
TEXT_CASES = {
    "llama_gqa_untied": ("llama", 4, 2, False),
    "qwen2_mqa_tied": ("qwen2", 4, 1, True),
    "qwen3_qknorm_untied": ("qwen3", 4, 2, False),
}


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """Make this process believe it is `rank` of `world_size` (no group: only for code that issues no collective)."""
    saved = parallel_state._INFO
    parallel_state._INFO = parallel_state.TensorParallelInfo(rank, world_size)
    try:
        yield
    finally:
        parallel_state._INFO = saved


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    return {
        name: build_text_checkpoint(
            str(tmp_path_factory.mktemp(name)),
            arch=arch,
            num_heads=hq,
            num_kv_heads=hkv,
            tie_word_embeddings=tied,
            attention_bias=arch == "qwen3",
        )
        for name, (arch, hq, hkv, tied) in TEXT_CASES.items()
    }


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl")), num_key_value_heads=2)


def full_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, "pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    return shapes


def assert_same_logits(got: dict, want: dict) -> None:
    for got_step, want_step in zip(got["logits"], want["logits"], strict=True):
        assert got_step.keys() == want_step.keys()
        for seq in want_step:
            torch.testing.assert_close(got_step[seq], want_step[seq], atol=ATOL, rtol=RTOL)


def test_two_ranks_match_unsharded_logits(text_dirs, vl_dir):
    """One spawn of 2 ranks over every case: both ranks' logits equal the unsharded model's."""
    cases = {name: (d, False) for name, d in text_dirs.items()} | {"qwen2_vl": (vl_dir, True)}
    ranks = run_tensor_parallel(paged_step_logits_of_cases, 2, cases, PROMPTS, DECODES)
    for name, (model_dir, image) in cases.items():
        want = paged_step_logits(model_dir, PROMPTS, DECODES, image=image)
        assert want["logits"][0]["s0"].shape[-1] == AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
        for rank in ranks:
            assert_same_logits(rank[name], want)
        _check_reads(name, model_dir, [rank[name]["read_shapes"] for rank in ranks])


def _check_reads(name: str, model_dir: str, reads: list[dict]) -> None:
    """Each rank read half the rows of q_proj / gate_proj / embeddings and half the columns of o_proj / down_proj,
    its KV heads' rows of k_proj, and every other tensor (norms, the vision tower) whole."""
    full = full_shapes(model_dir)
    hkv = TEXT_CASES.get(name, (None, 4, 2))[2]
    for rank_reads in reads:
        assert rank_reads.keys() == full.keys()
        for n, shape in full.items():
            got = rank_reads[n]
            if "visual." in n or "norm" in n or n.endswith("o_proj.bias"):  # the row-parallel bias is whole
                assert got == shape, n
            elif any(p in n for p in ("q_proj", "gate_proj", "up_proj")):
                assert got == (shape[0] // 2, *shape[1:]), n
            elif any(p in n for p in ("k_proj", "v_proj")):
                assert got == ((shape[0] // hkv) * max(hkv // 2, 1), *shape[1:]), n
            elif "o_proj.weight" in n or "down_proj.weight" in n:
                assert got == (shape[0], shape[1] // 2), n
            elif "embed_tokens" in n or "lm_head" in n:
                assert got[0] in ((shape[0] + 1) // 2, shape[0] // 2) and got[1:] == shape[1:], n
            else:
                raise AssertionError(f"unclassified checkpoint tensor {n}")
    assert sum(sum(torch.Size(s).numel() for s in r.values()) for r in reads) < 2 * sum(
        torch.Size(s).numel() for s in full.values()
    )


@pytest.mark.slow
def test_compiled_decoder_two_ranks_match_unsharded(tmp_path):
    """-O1 (inductor, collectives as opaque custom ops) under TP=2 gives the eager unsharded logits. Rank 0 runs
    compiled and rank 1 eager (one inductor compile on a 2-core machine): the compiled graph must issue the same
    collectives in the same order as the eager forward, or the ranks deadlock or disagree."""
    model_dir = build_text_checkpoint(str(tmp_path / "llama"), arch="llama", num_layers=1)  # less to compile
    # the prefill shape class only (T >= 2): each further class is another inductor compile in every rank
    ranks = run_tensor_parallel(paged_step_logits, 2, model_dir, PROMPTS, [], str(tmp_path / "cache"), False, 0)
    want = paged_step_logits(model_dir, PROMPTS, [])
    for rank in ranks:
        assert_same_logits(rank, want)


# ---- in-process checks with a faked rank ----------------------------------------------------------------------


def test_unsharded_names_and_shapes_unchanged(text_dirs):
    model_dir = text_dirs["llama_gqa_untied"]
    model = load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (689, 64)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 * 2) * 16, 64)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (256, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 64)
    assert model.checkpoint_shard("model.layers.0.self_attn.q_proj.weight") is None


def test_replicated_kv_head_follows_the_rank(text_dirs):
    """Hkv=1 over 2 ranks: both ranks load kv head 0 whole; q heads split; vocab rows padded with zeros."""
    model_dir = text_dirs["qwen2_mqa_tied"]
    cfg = AutoConfig.from_pretrained(model_dir)
    whole = load_model(model_dir, cfg, torch.float32, "cpu")
    for rank in (0, 1):
        with fake_rank(rank, 2):
            part = load_model(model_dir, cfg, torch.float32, "cpu")
        qkv, full_qkv = part.model.layers[0].self_attn.qkv_proj, whole.model.layers[0].self_attn.qkv_proj
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        torch.testing.assert_close(qkv.weight[:32], full_qkv.weight[rank * 32 : (rank + 1) * 32])
        torch.testing.assert_close(qkv.weight[32:], full_qkv.weight[64:])  # k and v of the one kv head
        torch.testing.assert_close(qkv.bias[32:], full_qkv.bias[64:])
        emb = part.model.embed_tokens.weight
        assert emb.shape == (345, 64) and part.lm_head.weight is emb
        valid = 345 - rank
        torch.testing.assert_close(emb[:valid], whole.model.embed_tokens.weight[rank * 345 : rank * 345 + valid])
        assert rank == 0 or not emb[344].any()  # the padding row of the last rank is zero


def test_towers_are_replicated_in_checkpoint_shard(tmp_path):
    """A LLaVA tower's `self_attn.q_proj` names are read whole; the decoder's are sharded."""
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint
    from vlserve.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(build_llava_checkpoint(str(tmp_path / "llava"), vision_depth=1, num_layers=1))
    with fake_rank(1, 2), torch.device("meta"):
        model = get_model_class(cfg)(cfg)
        tower = [f"{p}vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" for p in ("", "model.")]
        assert all(model.checkpoint_shard(n) is None for n in tower)
        assert model.checkpoint_shard("model.language_model.layers.0.self_attn.q_proj.weight") == (0, 32, 32)
        assert model.checkpoint_shard("model.language_model.layers.0.mlp.down_proj.weight") == (1, 64, 64)
        rows = -(-cfg.text_config.vocab_size // 2)
        assert model.checkpoint_shard("lm_head.weight") == (0, rows, cfg.text_config.vocab_size - rows)


@pytest.mark.parametrize(
    "heads, kv_heads, inter, match",
    [
        (3, 1, 128, r"num_attention_heads \(3\) must be divisible by tensor_parallel_size \(2\)"),
        (6, 3, 128, r"num_key_value_heads \(3\) must be a multiple or a divisor of tensor_parallel_size \(2\)"),
        (4, 2, 129, r"intermediate_size \(129\) must be divisible by tensor_parallel_size \(2\)"),
    ],
)
def test_unsplittable_sizes_are_value_errors(heads, kv_heads, inter, match):
    from transformers import LlamaConfig

    from vlserve.models.causal_lm import LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=48,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        num_hidden_layers=1,
        vocab_size=100,
    )
    with fake_rank(0, 2), torch.device("meta"), pytest.raises(ValueError, match=match):
        LlamaForCausalLM(cfg)


def test_eagle_is_refused_under_tensor_parallelism():
    from vlserve.spec_decode.eagle import build_eagle_proposer

    with fake_rank(0, 2), pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        build_eagle_proposer(None, None, 64, 4)


def test_kv_cache_shapes_are_per_rank(text_dirs):
    from vlserve.models import kv_cache_spec
    from vlserve.worker.model_runner import ModelRunner

    gqa = AutoConfig.from_pretrained(text_dirs["llama_gqa_untied"])
    mqa = AutoConfig.from_pretrained(text_dirs["qwen2_mqa_tied"])
    runner = ModelRunner(
        load_model(text_dirs["llama_gqa_untied"], gqa, "float32", "cpu"),
        gqa,
        torch.device("cpu"),
        torch.float32,
        block_size=4,
    )
    assert kv_cache_spec(gqa) == (2, 2, 16) and runner.kv_cache_shape(8) == (8, 4, 2, 16)
    whole_block = runner.bytes_per_block()
    with fake_rank(1, 2):
        assert kv_cache_spec(gqa) == (2, 1, 16) and kv_cache_spec(mqa) == (2, 1, 16)
        assert runner.kv_cache_shape(8) == (8, 4, 1, 16) and runner.bytes_per_block() == whole_block // 2
