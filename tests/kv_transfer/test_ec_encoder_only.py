"""E/PD disaggregation, engine level: an encode server (`mm_encoder_only`, as vLLM an
`ec_producer` alone turns it on) loads the towers only, holds no KV cache, encodes each request's media, publishes
it through the shared-storage connector and ends the request "length" with no tokens; a consumer engine then answers
the request with a plain engine's greedy tokens without running its tower."""

from __future__ import annotations

import pytest

from tests.kv_transfer.test_ec_shared_storage import GREEDY, KW, TEXT, _ec, _files, _gen, _image, _m
from vlserve import LLM
from vlserve.config import EngineArgs
from vlserve.worker.encoder_only_runner import EncoderOnlyRunner

DROPPED = ("language_model.layers.", "language_model.norm.", "lm_head.")  # what an encode server does not hold


def _numel(model, skip=()) -> int:
    params = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    return sum(p.numel() for n, p in params if not n.startswith(skip))


@pytest.mark.slow
def test_encode_server_publishes_and_consumer_answers_as_plain(qwen2_vl_dir, tmp_path):
    imgs = [_image(11), _image(12)]
    plain = LLM(qwen2_vl_dir, **KW)
    want = [_gen(plain, img) for img in imgs]
    assert want[0] != want[1]

    enc = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_producer", tmp_path), **KW)
    assert enc.engine_args.mm_encoder_only
    runner = enc.engine.runner
    assert isinstance(runner, EncoderOnlyRunner) and runner.kv_caches == []
    assert _m(enc, "num_kv_blocks") == 0
    names = [n for n, _ in runner.model.named_parameters()]
    assert names and not [n for n in names if n.startswith(DROPPED)]  # no decoder layer, norm nor lm_head
    # exactly the plain model's tower, projector / merger and token embeddings
    assert _numel(runner.model) == _numel(plain.engine.runner.model, DROPPED) < _numel(plain.engine.runner.model)
    for i, img in enumerate(imgs):
        out = enc.generate(TEXT, GREEDY, images=[img], use_tqdm=False)[0].outputs[0]
        assert (list(out.token_ids), out.text, out.finish_reason) == ([], "", "length")
        assert len(_files(tmp_path)) == i + 1  # one published file per image
    text_only = enc.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert (list(text_only.token_ids), text_only.finish_reason) == ([], "length")
    enc.check_integrity()  # no request, KV block or referenced encoder-cache entry left
    assert not enc.engine.scheduler.encoder_cache.req_to_hashes and not runner.requests
    assert _m(enc, "encoder_runs_total") == 2 and _m(enc, "ec_stores_total") == 2
    assert _m(enc, "generation_tokens_total") == 0
    # the same image again: an encoder-cache hit, nothing encoded nor written again
    enc.generate(TEXT, GREEDY, images=[imgs[0]], use_tqdm=False)
    assert _m(enc, "encoder_runs_total") == 2 and len(_files(tmp_path)) == 2

    consumer = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_consumer", tmp_path), **KW)
    assert [_gen(consumer, img) for img in imgs] == want
    assert _m(consumer, "encoder_runs_total") == 0 and _m(consumer, "ec_load_hits_total") == 2


@pytest.mark.slow
def test_encode_server_many_items_over_steps(qwen2_vl_dir, tmp_path):
    """Two images in one prompt with an encoder budget of one image per step: two steps, both published, the
    request ends once; a batch of requests ends together with nothing held."""
    enc = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_producer", tmp_path), max_num_encoder_input_tokens=1, **KW)
    outs = enc.generate(
        ["<image><image> two pictures", TEXT, TEXT],
        GREEDY,
        images=[[_image(21), _image(22)], [_image(23)], [_image(21)]],
        use_tqdm=False,
    )
    assert [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == [([], "length")] * 3
    assert len(_files(tmp_path)) == 3 and _m(enc, "encoder_runs_total") == 3
    assert enc.engine.num_steps >= 3  # one new item per step (a step's first item always runs)
    enc.check_integrity()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mm_encoder_only=True), "ec_producer"),
        (dict(mm_encoder_only=True, ec_transfer_config=_ec("ec_both", "/tmp/ec")), "ec_both"),
        (dict(mm_encoder_only=True, ec_transfer_config=_ec("ec_consumer", "/tmp/ec")), "ec_consumer"),
        (
            dict(
                ec_transfer_config=_ec("ec_producer", "/tmp/ec"),
                kv_transfer_config={"kv_connector": "P2PConnector", "kv_role": "kv_producer"},
            ),
            "kv_transfer_config",
        ),
        (dict(ec_transfer_config=_ec("ec_producer", "/tmp/ec"), enable_lora=True), "enable_lora"),
        (
            dict(
                ec_transfer_config=_ec("ec_producer", "/tmp/ec"),
                speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            ),
            "speculative_config",
        ),
    ],
)
def test_bad_encoder_only_flags(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="x", **kwargs)


def test_encoder_only_on_a_text_model_is_refused(qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match="mm_encoder_only needs a multimodal model"):
        LLM(qwen2_dir, ec_transfer_config=_ec("ec_producer", tmp_path), dtype="float32", num_kv_blocks=8)


def test_cli_mm_encoder_only_flag():
    from vlserve.cli import build_parser, serve_config_from_args

    p = build_parser()
    ec = (
        '{"ec_connector": "shared_storage", "ec_role": "ec_producer", '
        '"ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}'
    )
    assert serve_config_from_args(p.parse_args(["serve", "--mm-encoder-only", "--ec-transfer-config", ec]))[
        0
    ].mm_encoder_only
    with pytest.raises(ValueError, match="ec_producer"):
        serve_config_from_args(p.parse_args(["serve", "--mm-encoder-only"]))


def _family_dir(family: str, out: str) -> str:
    if family == "mistral3":  # its image break / end rows come from the token embeddings the encode server keeps
        from tests.support.mistral3_checkpoints import build_mistral3_checkpoint

        return build_mistral3_checkpoint(out)
    if family == "gemma3":  # sliding-window layers: KV cache groups on a full engine
        from tests.support.gemma3_checkpoints import build_gemma3_vlm_checkpoint

        return build_gemma3_vlm_checkpoint(out)
    if family == "qwen3_vl":  # DeepStack: rows wider than the hidden size
        from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

        return build_qwen3_vl_checkpoint(out)
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(out)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "mistral3", "gemma3", "qwen3_vl"])
def test_encode_server_other_families(family, tmp_path):
    from tests.kv_transfer.test_p2p_proxy_vl import _msgs

    model = _family_dir(family, str(tmp_path / "ckpt"))
    kw = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=512, seed=0)
    msgs = [_msgs(5), _msgs(6)]
    want = [list(o.outputs[0].token_ids) for o in LLM(model, **kw).chat(msgs, GREEDY, use_tqdm=False)]
    enc = LLM(model, ec_transfer_config=_ec("ec_producer", tmp_path / "ec"), **kw)
    assert not [n for n, _ in enc.engine.runner.model.named_parameters() if n.startswith(DROPPED)]
    assert [list(o.outputs[0].token_ids) for o in enc.chat(msgs, GREEDY, use_tqdm=False)] == [[], []]
    enc.check_integrity()
    consumer = LLM(model, ec_transfer_config=_ec("ec_consumer", tmp_path / "ec"), **kw)
    assert [list(o.outputs[0].token_ids) for o in consumer.chat(msgs, GREEDY, use_tqdm=False)] == want
    assert _m(consumer, "encoder_runs_total") == 0 and _m(consumer, "ec_load_hits_total") == 2


@pytest.mark.slow
def test_encode_server_audio(tmp_path):
    """Qwen2-Audio: an input_audio part through an encode server, then a consumer == a plain engine."""
    import base64

    from tests.multimodal.audio_media import encode_audio, tones
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

    model = build_qwen2_audio_checkpoint(str(tmp_path / "ckpt"))
    kw = dict(dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=512, seed=0)
    msgs = [
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_audio",
                        "input_audio": {
                            "data": base64.b64encode(encode_audio(tones(1.0, seed=s), 16000)).decode(),
                            "format": "wav",
                        },
                    },
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ]
        for s in (1, 2)
    ]
    want = [list(o.outputs[0].token_ids) for o in LLM(model, **kw).chat(msgs, GREEDY, use_tqdm=False)]
    enc = LLM(model, ec_transfer_config=_ec("ec_producer", tmp_path / "ec"), **kw)
    assert [list(o.outputs[0].token_ids) for o in enc.chat(msgs, GREEDY, use_tqdm=False)] == [[], []]
    assert _m(enc, "ec_stores_total") == 2
    consumer = LLM(model, ec_transfer_config=_ec("ec_consumer", tmp_path / "ec"), **kw)
    assert [list(o.outputs[0].token_ids) for o in consumer.chat(msgs, GREEDY, use_tqdm=False)] == want
    assert _m(consumer, "encoder_runs_total") == 0 and _m(consumer, "ec_load_hits_total") == 2
