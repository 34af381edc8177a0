"""The audio demo's trainer and eval: batches (answer labels, per-token probe targets), conversation order, a tiny
training run whose checkpoint transformers loads unchanged, and the eval's scoring."""

import json
import math
import os
import random

import pytest

from training.train_audio import make_batch, sample_turns, token_targets
from vlserve.demo import audio_world as aw


@pytest.fixture(scope="module")
def processor():
    from training.audio_build import build_audio_processor, build_audio_tokenizer

    return build_audio_processor(build_audio_tokenizer())


def test_describe_is_always_the_last_turn():
    rng = random.Random(4)
    seen_before = 0
    for _ in range(200):
        forms = [f for f, _, _ in sample_turns(rng, aw.sample_clip(rng), 3)]
        assert len(set(forms)) == len(forms)
        assert "describe" not in forms[:-1], forms
        seen_before += len(forms) > 1 and forms[-1] == "describe"
    assert seen_before > 10


def test_token_targets_follow_the_beeps():
    c = aw.Clip(
        (aw.Beep("low", "short", 0.10, 0.12, 300.0, 0.5), aw.Beep("high", "long", 0.50, 0.45, 2000.0, 0.5)),
        1.2,
        "white",
        0.01,
        0,
    )
    t = token_targets(c, 30)  # 40 ms a token
    assert t[0] == (0, 0, 0) and t[3] == (1, 1, 1) and t[8] == (0, 0, 0)
    assert t[13] == (3, 2, 2) and t[23] == (3, 2, 2) and t[25] == (0, 0, 0)


def test_batch_has_answer_labels_and_one_probe_target_per_audio_token(processor):
    batch = make_batch(random.Random(0), processor, batch_size=4, max_turns=3)
    audio_id = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert batch["input_features"].shape[1:] == (80, 500)
    for row, aux in zip(batch["input_ids"], batch["aux_targets"]):
        n_tokens = int((row == audio_id).sum())
        assert n_tokens > 10 and int((aux[:, 0] != -100).sum()) == n_tokens
        assert aux[:n_tokens, 2].max() >= 1, "some token lies inside a beep"
    labeled = batch["labels"][batch["labels"] != -100]
    assert len(labeled) > 0 and not (labeled == audio_id).any(), "only answers carry labels"


@pytest.mark.slow
def test_tiny_training_run_saves_a_checkpoint_transformers_loads(tmp_path):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from training.audio_build import AudioDemoSize
    from training.train_audio import train

    size = AudioDemoSize(
        encoder_dim=32,
        encoder_layers=1,
        encoder_heads=2,
        encoder_ffn_dim=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
    )
    out = str(tmp_path / "ckpt")
    summary = train(out, steps=3, batch_size=2, workers=0, log_every=1, warmup=1, size=size)
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"]) and len(summary["history"]) == 3
    processor = AutoProcessor.from_pretrained(out, local_files_only=True)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(out, local_files_only=True)
    assert type(processor).__name__ == "Qwen2AudioProcessor" and processor.feature_extractor.feature_size == 80
    assert model.config.audio_config.max_source_positions == 250 and os.path.isfile(f"{out}/model.safetensors")
    # transformers 4.x reads these: the feature extractor's own file and special tokens as a list it accepts
    assert os.path.isfile(f"{out}/preprocessor_config.json")
    with open(f"{out}/tokenizer_config.json") as f:
        tok_cfg = json.load(f)
    assert "<|AUDIO|>" in tok_cfg["additional_special_tokens"] and not tok_cfg.get("extra_special_tokens")
    assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "input_audio"}, {"type": "text", "text": "Hi"}]}], tokenize=False
    )


def test_eval_scores_exact_answers_per_form():
    from training.eval_audio import held_out_set, score

    items = held_out_set(2, seed=5)
    assert [it["form"] for it in items] == [f for f in aw.FORMS for _ in range(2)]
    assert [it["answer"] for it in held_out_set(2, seed=5)] == [it["answer"] for it in items]
    outputs = [it["answer"].upper() + " " for it in items]
    outputs[0] = "There are no beeps."
    acc = score(items, outputs)
    assert acc["count"] == 0.5 and acc["describe"] == 1.0 and acc["overall"] == pytest.approx(0.9)
