"""The pooling runner on a tiny Qwen2-VL (`convert="embed"` / `"classify"`): embeddings and reranker scores against
HF's last hidden state, chunked prefill, prefix caching, the encoder cache, KV blocks freed, bad requests."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.pooling_params import PoolingParams

pytestmark = pytest.mark.hf_parity


def _chat_text(tok, n_images: int, text: str) -> str:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl_pool")), variant="qwen2_vl")


@pytest.fixture(scope="module")
def hf(qwen2_vl_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(qwen2_vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32).eval()
    return processor, model


def _hf_last_hidden(hf, text: str, images=None) -> torch.Tensor:
    """HF's final (normed) hidden state of the prompt's last token, [H]."""
    processor, model = hf
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    return out.hidden_states[-1][0, -1].float()


@pytest.fixture(scope="module")
def embedder(qwen2_vl_dir):
    llm = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=128, runner="pooling", convert="embed")
    yield llm
    llm.shutdown()


def _cases(tok):
    img_a = Image.fromarray(rand_image(56, 84, seed=1))
    img_b = Image.fromarray(rand_image(56, 56, seed=2))
    return [
        (_chat_text(tok, 0, "a cat on a mat"), []),
        (_chat_text(tok, 1, "describe it"), [img_a]),
        (_chat_text(tok, 1, "and this one"), [img_b]),
    ]


def _prompts(cases):
    return [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text for text, imgs in cases]


def test_embed_matches_hf_last_token_normalized(embedder, hf):
    assert embedder.engine.runner_type == "pooling"
    assert embedder.engine.pooling_tasks == {"embed", "encode"}
    cases = _cases(embedder.tokenizer)
    outs = embedder.embed(_prompts(cases), use_tqdm=False)
    for out, (text, imgs) in zip(outs, cases):
        ours = torch.tensor(out.outputs.embedding)
        ref = torch.nn.functional.normalize(_hf_last_hidden(hf, text, imgs), dim=-1)
        assert ours.shape == ref.shape
        assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) >= 0.9999
        assert abs(float(ours.norm()) - 1.0) < 1e-5
    raw = embedder.encode(_prompts(cases[:1]), PoolingParams(task="encode"), use_tqdm=False)[0]
    ref = _hf_last_hidden(hf, *cases[0])
    assert torch.allclose(raw.outputs.data, ref, atol=1e-4)  # encode: not normalized
    embedder.check_integrity()
    assert embedder.engine.scheduler.kv.pool.num_free_blocks == embedder.engine.scheduler.kv.pool.num_usable_blocks


def test_chunked_prefill_and_prefix_hit_give_the_same_embedding(qwen2_vl_dir, embedder):
    cases = _cases(embedder.tokenizer)
    whole = [o.outputs.embedding for o in embedder.embed(_prompts(cases), use_tqdm=False)]
    again = embedder.embed(_prompts(cases), use_tqdm=False)  # prefix cache hits on every prompt
    hits = embedder.get_metrics()["vlserve:prefix_cache_hits_total"]
    assert hits > 0
    for a, b in zip(whole, again):
        assert (
            torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b.outputs.embedding), dim=0) > 0.99999
        )
    chunked = LLM(
        qwen2_vl_dir,
        dtype="float32",
        num_kv_blocks=128,
        runner="pooling",
        convert="embed",
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    try:
        outs = chunked.embed(_prompts(cases), use_tqdm=False)
        for a, b in zip(whole, outs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b.outputs.embedding), atol=1e-5)
        chunked.check_integrity()
    finally:
        chunked.shutdown()


def test_same_image_twice_runs_the_tower_once(qwen2_vl_dir):
    llm = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=128, runner="pooling", convert="embed")
    try:
        tok = llm.tokenizer
        img = Image.fromarray(rand_image(56, 84, seed=7))
        text = _chat_text(tok, 1, "same picture")
        prompt = {"prompt": text, "multi_modal_data": {"image": [img]}}
        first = llm.embed(prompt, use_tqdm=False)[0].outputs.embedding
        runs = llm.engine.executor.stats().num_encoder_runs
        other = {"prompt": _chat_text(tok, 1, "other words"), "multi_modal_data": {"image": [img]}}
        second = llm.embed([prompt, other], use_tqdm=False)
        assert llm.engine.executor.stats().num_encoder_runs == runs  # served from the encoder cache
        assert torch.allclose(torch.tensor(first), torch.tensor(second[0].outputs.embedding), atol=1e-6)
        llm.check_integrity()
    finally:
        llm.shutdown()


def _embed_counting_tower_calls(llm, prompts):
    model = llm.engine.runner.model
    calls = []
    tower = model.embed_multimodal
    model.embed_multimodal = lambda modality, data: (calls.append(modality), tower(modality, data))[1]
    try:
        return llm.embed(prompts, use_tqdm=False), calls
    finally:
        del model.embed_multimodal


def test_a_batch_of_mixed_image_sizes_shares_one_tower_call(qwen2_vl_dir):
    sizes = [(56, 56), (56, 84), (84, 112), (112, 56)]
    images = [Image.fromarray(rand_image(h, w, seed=20 + i)) for i, (h, w) in enumerate(sizes)]
    results = {}
    for together in (True, False):  # one embed call for all; one call (so one step) per image
        llm = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=256, runner="pooling", convert="embed")
        try:
            tok = llm.tokenizer
            prompts = [
                {"prompt": _chat_text(tok, 1, f"picture {i}"), "multi_modal_data": {"image": [img]}}
                for i, img in enumerate(images)
            ]
            if together:
                results[together] = _embed_counting_tower_calls(llm, prompts)
            else:
                runs = [_embed_counting_tower_calls(llm, [p]) for p in prompts]
                results[together] = [o for outs, _ in runs for o in outs], [c for _, calls in runs for c in calls]
            llm.check_integrity()
        finally:
            llm.shutdown()
    packed, packed_calls = results[True]
    single, single_calls = results[False]
    assert packed_calls == ["image"]  # no decode steps to keep short: the step's images share one tower call
    assert single_calls == ["image"] * len(images)
    for a, b in zip(packed, single):
        assert torch.allclose(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), atol=1e-5)


def test_yes_no_reranker_scores_match_hf(qwen2_vl_dir, hf):
    tok = hf[0].tokenizer
    no_token, yes_token = tok.convert_ids_to_tokens([101, 202])  # the tiny vocabulary has no "yes" / "no"
    llm = LLM(
        qwen2_vl_dir,
        dtype="float32",
        num_kv_blocks=128,
        runner="pooling",
        convert="classify",
        pooler_config={"classifier_from_token": [no_token, yes_token]},
    )
    try:
        assert llm.engine.pooling_tasks == {"classify", "score", "encode"}
        yes, no = 202, 101
        docs = ["a cat sat", "stock prices fell sharply today"]
        scores = llm.score("where is the cat?", docs, use_tqdm=False)
        _, model = hf
        for out, doc in zip(scores, docs):
            ids = tok("where is the cat?", doc)["input_ids"]
            assert out.prompt_token_ids == ids
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            ref = torch.sigmoid(logits[yes] - logits[no]).item()
            assert abs(out.outputs.score - ref) < 1e-4
        img = Image.fromarray(rand_image(56, 84, seed=11))  # an image document, formatted by the caller
        text = _chat_text(tok, 1, "is this a cat?")
        probs = llm.classify({"prompt": text, "multi_modal_data": {"image": [img]}}, use_tqdm=False)[0].outputs.probs
        inputs = hf[0](text=[text], images=[img], return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1].float()
        assert len(probs) == 1 and abs(probs[0] - torch.sigmoid(logits[yes] - logits[no]).item()) < 1e-4
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_bad_pooling_requests_are_value_errors(embedder, qwen2_vl_dir):
    with pytest.raises(ValueError, match="pools"):
        embedder.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="Matryoshka"):
        embedder.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="not served"):
        embedder.classify("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling task"):
        PoolingParams(task="nope").verify()
    embedder.check_integrity()
    assert not embedder.engine.has_unfinished_requests()


def test_blocks_cover_the_prompt_only(embedder):
    from vlserve.engine.engine_loop import NewRequest

    tok = embedder.tokenizer
    ids = tok("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen")["input_ids"]
    ids = (ids * 4)[:32]  # two full blocks of 16
    prompt = embedder.input_processor.process_prompt({"prompt_token_ids": ids})
    core = embedder.engine
    embedder.engine_loop.add_pooling_requests([NewRequest("blocks", prompt, PoolingParams(), 0.0)])
    so = core.scheduler.schedule()
    assert [len(b) for b in core.scheduler.kv.req_to_blocks["blocks"]] == [2]  # no block for a next token
    outs = core.scheduler.update_from_output(so, core.executor.execute_model(so))
    assert outs[0].finished and outs[0].new_token_ids == [] and outs[0].pooling_output.shape == (64,)
    assert not core.scheduler.kv.req_to_blocks
    embedder.engine_loop.pooling.open.clear()
    core.step()  # the runner drops the finished request's state
    embedder.check_integrity()


def test_conversations_and_cosine_scores(embedder, hf):
    img = Image.fromarray(rand_image(56, 84, seed=5))
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "what is shown?"}],
        }
    ]
    out = embedder.embed([conversation], use_tqdm=False)[0]
    text = _chat_text(embedder.tokenizer, 1, "what is shown?")
    ref = torch.nn.functional.normalize(_hf_last_hidden(hf, text, [img]), dim=-1)
    assert torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0) >= 0.9999
    scores = embedder.score("a cat", ["a cat", "a dog"], use_tqdm=False)
    a, b, c = (torch.tensor(e.outputs.embedding) for e in embedder.embed(["a cat", "a cat", "a dog"], use_tqdm=False))
    assert abs(scores[0].outputs.score - float(a @ b)) < 1e-5 and abs(scores[1].outputs.score - float(a @ c)) < 1e-5
    embedder.check_integrity()


def test_qwen3_vl_embedder_matches_hf(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

    model_dir = build_qwen3_vl_checkpoint(str(tmp_path / "qwen3_vl"))
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128, convert="embed")
    try:
        img = Image.fromarray(rand_image(64, 96, seed=9))
        text = _chat_text(llm.tokenizer, 1, "embed this")
        out = llm.embed({"prompt": text, "multi_modal_data": {"image": [img]}}, use_tqdm=False)[0]
        inputs = processor(text=[text], images=[img], return_tensors="pt")
        with torch.no_grad():
            ref = model(**inputs, output_hidden_states=True).hidden_states[-1][0, -1].float()
        ref = torch.nn.functional.normalize(ref, dim=-1)
        assert torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0) >= 0.9999
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_a_pooling_runner_leaves_float32_matrices_to_torch_where_its_sgemm_wins(embedder, qwen2_vl_dir):
    """Every pooling step prefills many rows: its float32 linears keep their matrices for torch's matmul where its
    sgemm beats the packed kernel at hundreds of rows (Intel CPUs), where a generating runner packs its decoder's
    for decode steps."""
    from vlserve.kernels.cpu_linear import cpu_linear_isa, torch_serves_many_rows
    from vlserve.kernels.packed_linear import PackableLinear

    if cpu_linear_isa(torch.float32) is None:
        pytest.skip("no packed CPU linear kernel on this machine")

    def linears(llm, packed: bool) -> set[str]:
        modules = llm.engine.runner.model.named_modules()
        return {n for n, m in modules if isinstance(m, PackableLinear) and (m.packed_weight is not None) == packed}

    if torch_serves_many_rows(torch.float32):
        assert linears(embedder, packed=True) == set()
        assert any(".mlp." in n for n in linears(embedder, packed=False))
    else:  # (not an Intel CPU: the packed kernel beat MKL's sgemm at many rows, so every matrix is packed)
        assert linears(embedder, packed=False) == set()
    generator = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=64)
    try:
        packed = linears(generator, packed=True)
        assert any(".mlp." in n for n in packed)
        # (towers: torch's where its sgemm wins at many rows)
        assert any("visual" in n for n in packed) != torch_serves_many_rows(torch.float32)
    finally:
        generator.shutdown()


def test_the_last_layer_computes_only_the_pooled_rows(embedder, hf):
    """LAST pooling reads one row per prompt: the decoder's last layer runs its o_proj and MLP on those rows alone
    (every row's K and V are still written), and the embeddings still match HF's."""
    from vlserve.models.llama import decoder_of

    decoder = decoder_of(embedder.engine.runner.model)
    rows_seen: list[int] = []
    hooks = [
        decoder.layers[decoder.num_layers - 1].mlp.register_forward_hook(
            lambda m, a, o: rows_seen.append(a[0].shape[0])
        ),
        decoder.layers[0].mlp.register_forward_hook(lambda m, a, o: rows_seen.append(-a[0].shape[0])),
    ]
    try:
        texts = [_chat_text(embedder.tokenizer, 0, t) for t in ("a red triangle", "two dogs run", "x")]
        outs = embedder.embed(texts, use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    first = [-n for n in rows_seen if n < 0]  # every prompt token of the step
    last = [n for n in rows_seen if n > 0]
    assert sum(first) >= 3 * len(texts)  # (the chat template's prefix may be a cache hit)
    assert sum(last) == len(texts)  # one row per prompt
    for out, text in zip(outs, texts):
        ref = torch.nn.functional.normalize(_hf_last_hidden(hf, text), dim=-1)
        assert torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0) >= 0.9999
    embedder.check_integrity()
