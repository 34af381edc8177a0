"""HF `generate` as a greedy oracle that ignores EOS, on transformers 4.x and 5.x alike (tests only)."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy_ignoring_eos(model, inputs: dict, max_new_tokens: int) -> torch.Tensor:
    """`model.generate(**inputs)` greedily for exactly `max_new_tokens` tokens with no EOS stop -> `[B, L + new]`.

    transformers 5.x fills generation options left unset (eos_token_id=None) from the model's generation config,
    and `min_new_tokens` would then mask the EOS logit; so EOS is removed from the model's own configs instead.
    """
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(**inputs, generation_config=cfg)
    if out.shape[1] != inputs["input_ids"].shape[1] + max_new_tokens:
        raise AssertionError(
            f"HF generate stopped early: {out.shape[1] - inputs['input_ids'].shape[1]} of {max_new_tokens} tokens"
        )
    return out


def hf_greedy_continuations(
    model_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
) -> list[list[int]]:
    """HF's greedy continuations (EOS ignored) of token-id prompts, one at a time, by a float32
    AutoModelForCausalLM of the text checkpoint at `model_dir`."""
    from transformers import AutoModelForCausalLM

    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval().to(device)
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = hf_greedy_ignoring_eos(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens)
        outs.append(gen[0, len(p) :].tolist())
    return outs


@torch.no_grad()
def hf_beam_search_ignoring_eos(model, inputs: dict, num_beams: int, max_new_tokens: int) -> list[list[int]]:
    """HF `generate` beam search (`num_beams` = `num_return_sequences`, no sampling, length_penalty 1, no early
    stopping) for exactly `max_new_tokens` tokens with no EOS -> the `num_beams` sequences' new tokens, best first."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        num_beams=num_beams,
        num_return_sequences=num_beams,
        do_sample=False,
        early_stopping=False,
        length_penalty=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )
    out = model.generate(**inputs, generation_config=cfg)
    return out[:, inputs["input_ids"].shape[1] :].tolist()


def transformers_major() -> int:
    """The installed transformers' major version (tests compare with HF behaviour that changed between 4.x and 5.x)."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def align_hf_video_inputs(inputs, fps: float | None, hf_config) -> str | None:
    """Make HF's video inputs mean what vlserve's do; return why HF cannot be the oracle for them, or None.

    1. `second_per_grid_ts` becomes what vlserve's processor computes for raw frames sampled at `fps`
       (temporal_patch_size / fps, 2.0 fps when unknown), as transformers 4.57's processor returns it; 5.x's
       ignores `fps` for raw frames and assumes 24 fps.
    2. transformers 5.x's `get_rope_index` starts the text after a video at offset + max(h, w) (merged grid),
       where Qwen2-VL / Qwen2.5-VL were trained with (largest position of the video) + 1, which vlserve keeps
       (as do 4.57 and vLLM). The two agree unless the video's temporal positions run past its spatial ones;
       when they do not agree, the reason is returned so the caller can skip (the 4.57 hf_parity job checks
       those inputs against HF).
    """
    import torch
    import transformers

    from vlserve.multimodal.processor import DEFAULT_VIDEO_FPS

    grids = inputs.get("video_grid_thw")
    if grids is None:
        return None
    spg = 2.0 / float(fps or DEFAULT_VIDEO_FPS)
    if "second_per_grid_ts" in inputs:
        inputs["second_per_grid_ts"] = torch.full((grids.shape[0],), spg)
    if transformers_major() < 5:
        return None
    vcfg = getattr(hf_config, "vision_config", hf_config)
    merge = int(vcfg.spatial_merge_size)
    tps = getattr(vcfg, "tokens_per_second", None)
    interval = int(spg) * tps if tps is not None else 1  # vlserve.multimodal.mrope's rule
    for t, h, w in grids.tolist():
        if (t - 1) * interval > max(h, w) // merge - 1:
            return (
                f"transformers {transformers.__version__} places text after this video (grid {t}x{h}x{w}) "
                f"by max(h, w), not by the video's last position + 1 as the checkpoints were trained; "
                f"checked against transformers 4.57 in the hf_parity job"
            )
    return None
