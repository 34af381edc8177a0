"""`mm_encoder_tp_mode` end to end through LLM at tensor_parallel_size=2: greedy tokens in `"data"` mode (items
divided among the ranks) and `"weights"` mode (Qwen towers split by heads, other towers replicated) equal one rank's
on Qwen2-VL (images and videos of mixed sizes, in one step), and the two modes' on LLaVA and with staged slices;
the ranks really divided the items (each encoded some, together all of them)."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image, rand_video
from tests.multimodal.test_mm_engine_parity import _chat_text, _greedy
from vlserve import LLM

pytestmark = pytest.mark.slow


def _img(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(rand_image(h, w, seed=seed))


def _generate(
    model_dir: str, mode: str, prompts: list[dict], tp: int = 2, **engine_kwargs
) -> tuple[list[list[int]], list[dict] | None, dict]:
    """(greedy tokens per prompt, each rank's shard_info (None at TP 1), the metrics) of one engine of `tp` ranks in
    this encoder mode; every item of the prompts is encoded in the first step (a large encoder budget)."""
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=2048,
        max_num_encoder_input_tokens=2048,
        tensor_parallel_size=tp,
        mm_encoder_tp_mode=mode,
        **engine_kwargs,
    )
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]
        info = llm.engine.executor.collective_rpc("shard_info") if tp > 1 else None
        metrics = llm.get_metrics()
        llm.check_integrity()
    finally:
        llm.shutdown()
    return got, info, metrics


def _check_split(info: list[dict], metrics: dict, mode: str) -> None:
    total = metrics["vlserve:encoder_runs_total"]
    runs = [rank["encoder_items_run_here"] for rank in info]
    assert [rank["split_encoder_items"] for rank in info] == [mode == "data"] * 2
    if mode == "data":
        assert sum(runs) == total and min(runs) > 0, runs
    else:
        assert runs == [total, total]


def test_qwen2_vl_both_modes_equal_one_rank(qwen2_vl_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    images = [_img(56, 84, 1), _img(112, 56, 2), _img(28, 28, 3), _img(84, 84, 4), _img(56, 140, 5)]
    videos = [rand_video(4, 84, 84, seed=6), rand_video(2, 56, 56, seed=7)]
    prompts = [
        {"prompt": _chat_text(tok, 1, 0, "What is this?"), "multi_modal_data": {"image": images[:1]}},
        {"prompt": _chat_text(tok, 2, 0, "Compare them."), "multi_modal_data": {"image": images[1:3]}},
        {"prompt": _chat_text(tok, 1, 1, "Both?"), "multi_modal_data": {"image": images[3:4], "video": videos[:1]}},
        {"prompt": _chat_text(tok, 1, 1, "And these?"), "multi_modal_data": {"image": images[4:], "video": videos[1:]}},
        {"prompt": _chat_text(tok, 0, 0, "Hello there"), "multi_modal_data": {}},
    ]
    want, _, _ = _generate(qwen2_vl_dir, "data", prompts, tp=1)  # one rank: the mode has no effect
    weights, weights_info, metrics = _generate(qwen2_vl_dir, "weights", prompts)
    _check_split(weights_info, metrics, "weights")
    assert weights == want
    data, info, metrics = _generate(qwen2_vl_dir, "data", prompts)
    _check_split(info, metrics, "data")
    assert weights_info[0]["num_params"] < info[0]["num_params"]  # weights: the tower's blocks split too
    assert metrics["vlserve:encoder_runs_total"] == 7
    assert data == want
    assert want[0] != want[1]


def test_pruned_videos_split_over_the_ranks_equal_one_rank(qwen2_vl_dir):
    """Videos with half their tokens pruned (EVS): each rank's tower runs on its videos whole, every rank prunes the
    gathered rows the same way; greedy tokens as one rank's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    videos = [rand_video(4, 84, 84, seed=6), rand_video(4, 56, 84, seed=8), rand_video(2, 56, 56, seed=7)]
    prompts = [
        {"prompt": _chat_text(tok, 0, 2, "Compare them."), "multi_modal_data": {"video": videos[:2]}},
        {"prompt": _chat_text(tok, 0, 1, "What happens?"), "multi_modal_data": {"video": videos[2:]}},
    ]
    want, _, _ = _generate(qwen2_vl_dir, "data", prompts, tp=1, video_pruning_rate=0.5)
    got, info, metrics = _generate(qwen2_vl_dir, "data", prompts, video_pruning_rate=0.5)
    _check_split(info, metrics, "data")
    assert got == want


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(str(tmp_path_factory.mktemp("llava_enc_tp")), num_layers=2)


def test_llava_data_mode_equals_replicated_towers(llava_dir):
    """LLaVA's CLIP tower is not split in weights mode: every rank runs it whole."""
    from transformers import AutoProcessor

    from tests.multimodal.test_llava import _user

    processor = AutoProcessor.from_pretrained(llava_dir)

    def text(n: int, question: str) -> str:
        return processor.apply_chat_template(_user(n, question), tokenize=False, add_generation_prompt=True)

    prompts = [
        {"prompt": text(1, "What is this?"), "multi_modal_data": {"image": [_img(40, 60, 0)]}},
        {"prompt": text(2, "Compare them."), "multi_modal_data": {"image": [_img(32, 400, 7), _img(64, 64, 8)]}},
        {"prompt": text(1, "And this?"), "multi_modal_data": {"image": [_img(50, 30, 9)]}},
    ]
    want, _, _ = _generate(llava_dir, "weights", prompts)
    got, info, metrics = _generate(llava_dir, "data", prompts)
    _check_split(info, metrics, "data")
    assert got == want


def test_qwen2_vl_modes_agree_with_staged_slices(tmp_path_factory):
    """A budget of 2 embeddings a step: the larger images' towers run a slice of blocks per step (on every rank; in
    weights mode each slice's blocks split by heads), small ones whole (in data mode divided among the ranks); the
    greedy tokens of both modes agree."""
    from transformers import AutoTokenizer

    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl_deep")), vision_depth=4, seed=5)
    tok = AutoTokenizer.from_pretrained(model_dir)
    images = [_img(112, 84, 1), _img(28, 28, 2), _img(56, 112, 3), _img(28, 56, 4)]
    prompts = [
        {"prompt": _chat_text(tok, 2, 0, "Compare them."), "multi_modal_data": {"image": images[:2]}},
        {"prompt": _chat_text(tok, 2, 0, "And these?"), "multi_modal_data": {"image": images[2:]}},
    ]
    results = {}
    for mode in ("weights", "data"):
        llm = LLM(
            model_dir,
            dtype="float32",
            num_kv_blocks=256,
            max_num_encoder_input_tokens=2,
            tensor_parallel_size=2,
            mm_encoder_tp_mode=mode,
        )
        schedule, slices = llm.engine.scheduler.schedule, []

        def recording_schedule(*args, _schedule=schedule, _slices=slices, **kwargs):
            so = _schedule(*args, **kwargs)
            _slices.extend(piece for pieces in so.scheduled_encoder_slices.values() for piece in pieces)
            return so

        llm.engine.scheduler.schedule = recording_schedule
        try:
            results[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]
            assert slices, "no item was encoded over several steps"
            assert llm.get_metrics()["vlserve:encoder_runs_total"] == 4
            llm.check_integrity()
        finally:
            llm.shutdown()
    assert results["data"] == results["weights"]
