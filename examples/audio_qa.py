"""Questions about an audio clip to the audio demo model ("vlserve-demo-audio"): offline through `LLM.chat`, through
a running server (`--server`, the openai client with an `input_audio` part), or with transformers (`--engine hf`).

    python examples/audio_qa.py                                   # renders a clip of beeps, asks LLM.chat
    python examples/audio_qa.py --seed 7 --save clip.wav          # another clip, also written to a file
    python examples/audio_qa.py --server http://127.0.0.1:8000/v1 # vlserve serve vlserve-demo-audio
    python examples/audio_qa.py --engine hf                       # HF Qwen2AudioForConditionalGeneration
"""

import argparse
import base64
import random
import time

QUESTIONS = [
    "How many beeps are there?",
    "Is the first beep high, middle or low?",
    "Is the last beep high, middle or low?",
    "Which beep is the longest?",
    "Describe the audio.",
]
MAX_TOKENS = 40


def render_clip(seed: int):
    """(clip, float32 waveform at 16 kHz, WAV bytes) from the demo's audio world."""
    from vlserve.demo import audio_world

    clip = audio_world.sample_clip(random.Random(seed))
    samples = audio_world.render(clip)
    return clip, samples, audio_world.to_wav_bytes(samples)


def audio_part(wav: bytes) -> dict:
    """An OpenAI chat `input_audio` part carrying the WAV file as base64."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode("ascii"), "format": "wav"}}


def ask_offline(model: str, wav: bytes, questions: list[str]) -> list[str]:
    from vlserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32")
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    replies = []
    for q in questions:
        t = time.perf_counter()
        out = llm.chat(
            [{"role": "user", "content": [audio_part(wav), {"type": "text", "text": q}]}], sp, use_tqdm=False
        )[0]
        replies.append(out.outputs[0].text)
        print(f"{q} -> {out.outputs[0].text!r}  ({time.perf_counter() - t:.2f} s)")
    return replies


def ask_server(base_url: str, api_key: str, wav: bytes, questions: list[str]) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id
    replies = []
    for q in questions:
        t = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            max_tokens=MAX_TOKENS,
            temperature=0,
            messages=[{"role": "user", "content": [audio_part(wav), {"type": "text", "text": q}]}],
        )
        replies.append(reply.choices[0].message.content)
        print(
            f"{q} -> {reply.choices[0].message.content!r}  ({time.perf_counter() - t:.2f} s, "
            f"{reply.usage.prompt_tokens} prompt tokens)"
        )
    return replies


def ask_hf(model: str, samples, questions: list[str]) -> list[str]:
    """Greedy answers from transformers' Qwen2AudioForConditionalGeneration + AutoProcessor (one left-padded batch)."""
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from vlserve.demo import DEMO_MODELS, demo_model_path
    from vlserve.demo.audio_world import SAMPLE_RATE

    path = demo_model_path(model) if model in DEMO_MODELS else model
    t = time.perf_counter()
    torch.set_num_threads(2)
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    processor.tokenizer.padding_side = "left"
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    turns = [[{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": q}]}] for q in questions]
    texts = [processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) for turn in turns]
    batch = processor(
        text=texts, audio=[samples] * len(questions), sampling_rate=SAMPLE_RATE, padding=True, return_tensors="pt"
    )
    with torch.inference_mode():
        gen = hf.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False)  # [B, L + new]
    replies = processor.tokenizer.batch_decode(gen[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    for q, r in zip(questions, replies):
        print(f"{q} -> {r!r}")
    print(f"({len(questions)} answers in {time.perf_counter() - t:.2f} s)")
    return replies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=3, help="which clip to render")
    p.add_argument("--save", help="also write the clip to this .wav file")
    p.add_argument("--model", default="vlserve-demo-audio", help="checkpoint directory or demo name (offline)")
    p.add_argument("--engine", choices=("vlserve", "hf"), default="vlserve", help="who answers offline")
    p.add_argument("--server", "--base-url", dest="server", help="ask a running server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    args = p.parse_args()
    clip, samples, wav = render_clip(args.seed)
    if args.save:
        with open(args.save, "wb") as f:
            f.write(wav)
    print(
        f"clip (seed {args.seed}, {clip.seconds:.2f} s, {clip.noise_colour} noise): "
        + ", ".join(f"{b.pitch} {b.length} at {b.start:.2f} s" for b in clip.beeps)
    )
    if args.server:
        ask_server(args.server, args.api_key, wav, QUESTIONS)
    elif args.engine == "hf":
        ask_hf(args.model, samples, QUESTIONS)
    else:
        ask_offline(args.model, wav, QUESTIONS)


if __name__ == "__main__":
    main()
