"""Compilation config, padded decode buckets (the path CUDA graphs replay) and compiled == eager greedy output."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import qwen2_dir, varied_prompts  # noqa: F401  (session fixture)
from vlserve import LLM, SamplingParams
from vlserve.config import CompilationConfig, EngineArgs, default_capture_sizes
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.worker.cuda_graphs import CudaGraphRunner, DecodeBuffers, StepInputs, bucket_for

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def _greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """One inductor cache per test session: the second engine of the same model finds its kernels on disk."""
    return str(tmp_path_factory.mktemp("compile_cache"))


# -- configuration ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, match",
    [
        (4, "level must be an integer 0..3"),
        (-1, "level must be an integer 0..3"),
        (True, "int level or a dict"),
        ("fast", "a level 0..3 or a JSON object"),
        ({"level": "2"}, "level must be an integer"),
        ({"cudagraph_capture_sizes": [4, -2]}, "must all be >= 1"),
        ({"cudagraph_capture_sizes": [0]}, ">= 1"),
        ({"cudagraph_capture_sizes": "1,2"}, "list of integers"),
        ({"mode": 3}, "unknown keys \\['mode'\\]"),
        ([3], "int level or a dict"),
        ({"inductor_compile_config": "freezing"}, "JSON object of inductor options"),
    ],
)
def test_bad_compilation_config_is_a_value_error(value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(compilation_config=value)


def test_compilation_config_values_and_defaults(monkeypatch):
    monkeypatch.delenv("VLSERVE_DEFAULT_COMPILE_LEVEL", raising=False)  # tests/conftest sets it to 0 on CUDA
    assert EngineArgs(compilation_config=3).compilation_config.level == 3
    assert EngineArgs(compilation_config="1").compilation_config.level == 1
    cfg = EngineArgs(compilation_config='{"level": 2, "cudagraph_capture_sizes": [8, 1, 8]}').compilation_config
    assert (cfg.level, cfg.cudagraph_capture_sizes) == (2, [1, 8])
    default = CompilationConfig()
    assert default.resolved_level("cpu") == 0 and default.resolved_level("cuda") == 2
    assert CompilationConfig(level=3).resolved_level("cuda", enforce_eager=True) == 0
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_capture_sizes(3) == [1, 2, 3] and default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    # inductor options: frozen weights (prepacked oneDNN linears) on CPU, autotuning at -O3 on CUDA; the user's win
    assert default.inductor_options("cpu") == {"freezing": True, "size_asserts": False, "alignment_asserts": False}
    assert default.inductor_options("cuda") == {}
    assert CompilationConfig(level=3).inductor_options("cuda") == {"max_autotune": True}
    off = EngineArgs(compilation_config='{"level": 1, "inductor_compile_config": {"freezing": false}}')
    assert off.compilation_config.inductor_options("cpu") == {
        "freezing": False,
        "size_asserts": False,
        "alignment_asserts": False,
    }


def test_serve_flags():
    from vlserve.cli import build_parser, serve_config_from_args

    args, _ = serve_config_from_args(build_parser().parse_args(["serve", "-O3", "--enforce-eager"]))
    assert args.compilation_config.level == 3 and args.enforce_eager
    args, _ = serve_config_from_args(
        build_parser().parse_args(["serve", "--compilation-config", '{"level": 1, "cache_dir": "/tmp/x"}'])
    )
    assert (args.compilation_config.level, args.compilation_config.cache_dir) == (1, "/tmp/x")


# -- padded buckets ----------------------------------------------------------------------------------------------
def _decode_step(seq_lens: list[int], block_size: int = 4) -> StepInputs:
    b = len(seq_lens)
    blocks = [-(-n // block_size) for n in seq_lens]
    table = torch.zeros(b, max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    pos = torch.tensor(seq_lens) - 1
    slots = table[torch.arange(b), pos // block_size].long() * block_size + pos % block_size  # [B]
    md = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        num_decodes=b,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(b + 1)),
        seq_lens_cpu=list(seq_lens),
    )
    return StepInputs(torch.arange(7, 7 + b), pos, md)


def test_decode_buffers_pad_rows_to_no_op_sequences():
    buffers = DecodeBuffers(max_seqs=8, max_blocks=6, block_size=4, mrope=False, device=torch.device("cpu"))
    buffers.load(_decode_step([9, 9, 9, 9, 9]), 8)  # leaves stale rows behind
    step = _decode_step([5, 13, 2])
    padded = buffers.load(step, 4)
    md = padded.metadata
    assert padded.input_ids.tolist() == [7, 8, 9, 0] and padded.positions.tolist() == [4, 12, 1, 0]
    assert md.slot_mapping.tolist() == step.metadata.slot_mapping.tolist() + [-1]  # the padding writes no KV
    assert md.seq_lens.tolist() == [5, 13, 2, 1] and md.seq_lens_cpu == [5, 13, 2, 1]
    assert md.block_tables.shape == (4, 6) and md.block_tables[3].tolist() == [0] * 6
    assert md.block_tables[:3, :4].tolist() == step.metadata.block_tables.tolist()
    assert (md.num_decodes, md.num_seqs, md.query_start_loc_cpu) == (4, 4, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="cannot pad"):
        buffers.load(step, 2)
    mrope = DecodeBuffers(max_seqs=4, max_blocks=6, block_size=4, mrope=True, device=torch.device("cpu"))
    step.positions = torch.stack([step.positions, step.positions + 1, step.positions + 2])  # [3, B]
    assert mrope.load(step, 4).positions.tolist() == [[4, 12, 1, 0], [5, 13, 2, 0], [6, 14, 3, 0]]


def pad_decode_steps(llm, sizes: list[int]) -> list[tuple[int, int]]:
    """Route the engine's decode steps through DecodeBuffers + the forward a CUDA graph captures, run eagerly;
    returns the (batch, bucket) pairs seen."""
    runner = llm.engine.runner
    buffers = DecodeBuffers(max(sizes), 64, runner.block_size, runner.mrope_positions_fn is not None, runner.device)
    seen = []

    def forward(step):
        seen.append((sum(n > 1 for n in step.metadata.seq_lens_cpu), step.metadata.num_seqs))
        return runner.forward.run(step, runner.kv_caches)

    runner.forward.graph_runner = CudaGraphRunner(forward, buffers, sizes, 1024, use_graphs=False)
    return seen


def test_padded_decode_buckets_match_unpadded(qwen2_dir):
    prompts = varied_prompts(_vocab(qwen2_dir), lengths=(3, 17, 40, 9, 25))
    params = [_greedy(n) for n in (12, 5, 9, 7, 3)]  # finishing one by one: batches 5, 4, 3, 2, 1
    expected = [
        o.outputs[0].token_ids
        for o in LLM(qwen2_dir, dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64)
    seen = pad_decode_steps(llm, [1, 2, 4, 8])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert {(5, 8), (3, 4), (1, 1)} <= set(seen)  # padded and exact buckets both ran
    m = llm.get_metrics()  # every decode step went through the graph runner, the prefills did not
    assert m["vlserve:cuda_graph_replays_total"] == len(seen) and m["vlserve:eager_forwards_total"] > 0
    llm.check_integrity()


# -- compiled == eager ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_equals_eager_chunked_preempted_and_ngram(qwen2_dir, compile_cache):
    prompts = varied_prompts(_vocab(qwen2_dir), lengths=(1, 3, 17, 40, 95, 160))
    g = torch.Generator().manual_seed(2)
    spec_prompts = [torch.randint(3, 600, (5 + i % 4,), generator=g).tolist() * (4 + i % 3) for i in range(3)]
    # 24 blocks of 16 cannot hold the whole batch: requests are preempted; 32-token steps chunk the prefills
    kw = {"dtype": "float32", "num_kv_blocks": 24, "max_num_batched_tokens": 32}
    for extra, batch in (({}, prompts), ({"speculative_config": NGRAM, "num_kv_blocks": 64}, spec_prompts)):
        eager = LLM(qwen2_dir, **{**kw, **extra}, enforce_eager=True)
        compiled = LLM(qwen2_dir, **{**kw, **extra}, compilation_config={"level": 1, "cache_dir": compile_cache})
        assert compiled.engine.runner.forward.compiled is not None and eager.engine.runner.forward.compiled is None
        expected = [o.outputs[0].token_ids for o in eager.generate(batch, _greedy(), use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in compiled.generate(batch, _greedy(), use_tqdm=False)]
        assert got == expected
        compiled.check_integrity()
        metrics, eager_metrics = compiled.get_metrics(), eager.get_metrics()
        if extra:  # drafts were verified (multi-token decode queries) and accepted alike
            assert metrics["vlserve:spec_decode_num_draft_tokens_total"] > 0
            accepted = "vlserve:spec_decode_num_accepted_tokens_total"
            assert metrics[accepted] == eager_metrics[accepted]
        else:
            assert metrics["vlserve:num_preemptions_total"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_equal_eager(qwen2_dir, compile_cache):
    prompts = varied_prompts(_vocab(qwen2_dir), lengths=(3, 17, 40, 9, 25))
    params = [_greedy(n) for n in (12, 5, 9, 7, 3)]
    eager = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64, enforce_eager=True)
    graphed = LLM(
        qwen2_dir,
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=8,
        compilation_config={"level": 2, "cudagraph_capture_sizes": [1, 2, 4, 8], "cache_dir": compile_cache},
    )
    assert sorted(graphed.engine.runner.forward.graph_runner.graphs) == [1, 2, 4, 8]
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)] == expected
    assert graphed.get_metrics()["vlserve:cuda_graph_replays_total"] > 0  # the graphs ran, not only eager


@pytest.mark.slow
def test_compiled_equals_eager_qwen2_vl_with_images(tmp_path_factory, compile_cache):
    from PIL import Image

    from tests.multimodal.mm_media import rand_image
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl")), variant="qwen2_vl")
    # 16-token steps split the image placeholders across chunks; M-RoPE [3, T] positions and merged embeddings
    kw = {"dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    eager = LLM(model_dir, **kw, enforce_eager=True)
    tok = eager.get_tokenizer()

    def chat(n_images: int, question: str) -> str:
        parts = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
        return tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)

    images = [Image.fromarray(rand_image(56, 84, seed=s)) for s in (1, 2)]
    prompts = [
        {"prompt": chat(1, "What is this?"), "multi_modal_data": {"image": [images[0]]}},
        {"prompt": chat(2, "Compare them."), "multi_modal_data": {"image": images}},
        {"prompt": chat(0, "Hello there")},
    ]
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, _greedy(8), use_tqdm=False)]
    from torch._dynamo.utils import guard_failures

    guard_failures.clear()
    compiled = LLM(model_dir, **kw, compilation_config={"level": 1, "cache_dir": compile_cache})
    assert compiled.engine.runner.forward.compiled is not None
    from torch._dynamo.utils import counters

    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, _greedy(8), use_tqdm=False)] == expected
    # the warm-up compiled every class the steps use, media embeddings included: serving compiles nothing more
    # (a first image request used to wait seconds for its class to compile)
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up
    compiled.check_integrity()
    # the warm-up's dummy inputs and the steps' (ids, [3, T] M-RoPE positions) are all normal tensors: no
    # recompile for a dispatch-key difference (inference-mode tensors) as the first GPU check saw
    reasons = [str(r) for failures in guard_failures.values() for r in failures]
    assert reasons and not [r for r in reasons if "dispatch key set" in r], reasons


@pytest.mark.slow
def test_warm_up_compiles_each_row_range(qwen2_dir, compile_cache, monkeypatch):
    """From `onednn_rows` rows on a linear hands its rows to oneDNN, so the compiled forward guards there; the
    warm-up compiles that range too and serving compiles nothing (the break forced to 8 rows, on any CPU)."""
    from torch._dynamo.utils import counters

    from vlserve.kernels import cpu_linear as cl
    from vlserve.kernels.packed_linear import row_breaks
    from vlserve.models.llama import decoder_of

    if cl.cpu_linear_isa(torch.bfloat16) is None:
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA, or no toolchain")
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "8")
    kw = {"dtype": "bfloat16", "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    llm = LLM(qwen2_dir, **kw, compilation_config={"level": 1, "cache_dir": compile_cache})
    assert row_breaks(decoder_of(llm.engine.runner.model)) == [8]
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    # 16-token chunks and decode batches of 1-3 rows: steps on both sides of the break
    outs = llm.generate(varied_prompts(_vocab(qwen2_dir), lengths=(3, 17, 40)), _greedy(6), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up
    llm.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_engines_run_projections_through_the_packed_kernel(qwen2_dir, compile_cache, monkeypatch, dtype):
    from transformers import AutoConfig

    from vlserve.kernels import cpu_linear as cl

    if cl.cpu_linear_isa(getattr(torch, dtype)) is None:
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA, or no toolchain")
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "0")  # every row count through the kernel (test_onednn_rows: the split)
    calls = []  # (rows, silu_mul, out_features) of every kernel call
    kernel = cl.cpu_linear_kernel()
    monkeypatch.setattr(
        cl, "cpu_linear_kernel", lambda: lambda *args: calls.append((args[7], args[12], args[8])) or kernel(*args)
    )
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    layers = cfg.num_hidden_layers
    prompts = varied_prompts(_vocab(qwen2_dir), lengths=(3, 17, 40))
    kw = {"dtype": dtype, "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    for extra in ({"enforce_eager": True}, {"compilation_config": {"level": 1, "cache_dir": compile_cache}}):
        llm = LLM(qwen2_dir, **kw, **extra)
        model = llm.engine.runner.model
        packed = [name for name, _ in model.named_parameters() if name.endswith("packed_weight")]
        assert len(packed) == 4 * layers + 1  # qkv, o, gate_up, down of every layer, and the LM head
        assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
        calls.clear()
        outs = llm.generate(prompts, _greedy(6), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
        head = [r for r, _, n in calls if n == cfg.vocab_size]  # the LM head: the rows that sample, once a step
        projections = [(r, s) for r, s, n in calls if n != cfg.vocab_size]
        assert len(head) >= 6 and max(head) <= 3
        # every forward: 4 calls per layer; chunked prefill rows (up to 16) and decode rows (1 to 3)
        rows = [r for r, _ in projections]
        assert len(rows) % (4 * layers) == 0 and len(rows) >= 4 * layers * 8
        assert max(rows) == 16 and min(rows) <= 3
        # gate_up with SiLU(gate) * up in the same call wherever the MLP's I fills whole panels
        fused = sum(bool(s) for _, s in projections)
        assert fused == (len(projections) // 4 if cfg.intermediate_size % cl.PANEL == 0 else 0)
        llm.check_integrity()


def test_default_level_env_replaces_the_device_default(monkeypatch):
    from vlserve.config import CompilationConfig

    monkeypatch.delenv("VLSERVE_DEFAULT_COMPILE_LEVEL", raising=False)
    assert (CompilationConfig().resolved_level("cuda"), CompilationConfig().resolved_level("cpu")) == (2, 0)
    monkeypatch.setenv("VLSERVE_DEFAULT_COMPILE_LEVEL", "0")
    assert CompilationConfig().resolved_level("cuda") == 0
    assert CompilationConfig(level=2).resolved_level("cuda") == 2  # a level the config sets wins
    monkeypatch.setenv("VLSERVE_DEFAULT_COMPILE_LEVEL", "fast")
    with pytest.raises(ValueError, match="VLSERVE_DEFAULT_COMPILE_LEVEL must be 0..3"):
        CompilationConfig().resolved_level("cuda")
