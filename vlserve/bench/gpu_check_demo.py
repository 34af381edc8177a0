"""The GPU check's demo-model steps (issue 40, `vlserve.bench.gpu_check`): (g) the demo model's single stream,
(h) the encoder cache on vs off and EAGLE vs plain decoding. Each returns the step's record (figures, headline,
command); `s` is the run's size table (`gpu_check_steps.sizes(cfg)`)."""
from __future__ import annotations

import os
import time


# -- (g) the demo model, one stream ---------------------------------------------------------------------------------
def step_demo_single_stream(cfg, s):
    from vlserve import LLM, SamplingParams
    from vlserve.bench.spec_demo import conversations

    n = s["demo_tokens"]
    llm = LLM(None)
    conv = conversations(1, 4242, repeat=False)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.chat(conv, sp, use_tqdm=False)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        out = llm.chat(conv, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    o = out[0]
    decode = (o.metrics.last_token_time - o.metrics.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1)
    level = llm.engine.runner.forward.level
    llm.shutdown()
    return {"figures": {"tok/s (end to end)": round(n / best, 1), "decode ms/token": round(1000 * decode, 3),
                        "level": level},
            "headline": f"{n / best:.1f} tok/s, one image conversation, {n} tokens",
            "command": f"LLM(vlserve-demo).chat(1 demo conversation with an image, max_tokens={n}, ignore_eos)"}


# -- (h) encoder cache and EAGLE ------------------------------------------------------------------------------------
def step_encoder_cache(cfg, s):
    from vlserve.bench import mm_cache
    from vlserve.testing.vl_checkpoints import build_qwen2_vl_checkpoint

    m = s["mm_cache"]
    path = os.path.join(cfg["work_dir"], f"qwen2-vl-mm-{m['vision_depth']}-{m['vision_width']}-{m['image_size']}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        px = m["image_size"] ** 2
        build_qwen2_vl_checkpoint(path, hidden_size=256, intermediate_size=512, num_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, vision_depth=m["vision_depth"],
                                  vision_embed_dim=m["vision_width"], vision_num_heads=8 if m["vision_width"] >= 256
                                  else 2, mrope_section=(8, 12, 12), initializer_range=0.02, max_pixels=px,
                                  min_pixels=(m["image_size"] // 2) ** 2)
    images = mm_cache.make_images(m["num_images"], m["image_size"], 0)
    px = m["image_size"] ** 2
    kw = {"max_pixels": px, "min_pixels": px // 4}
    on = mm_cache.run(path, images, m["num_requests"], m["output_len"], True, kw)
    off = mm_cache.run(path, images, m["num_requests"], m["output_len"], False, kw)
    speed = on["req_per_s"] / off["req_per_s"]
    return {"figures": {"cache on req/s": round(on["req_per_s"], 2), "cache off req/s": round(off["req_per_s"], 2),
                        "throughput on/off": f"{speed:.2f}x",
                        "mean TTFT off/on": f"{off['mean_ttft'] / on['mean_ttft']:.2f}x",
                        "encoder runs on / off": f"{on['encoder_runs']} / {off['encoder_runs']}"},
            "headline": f"encoder cache {speed:.2f}x throughput",
            "command": f"python -m vlserve.bench.mm_cache --num-requests {m['num_requests']} --num-images "
                       f"{m['num_images']} --image-size {m['image_size']} --vision-depth {m['vision_depth']} "
                       f"--vision-width {m['vision_width']} --output-len {m['output_len']} (in process)"}


def step_eagle(cfg, s):
    from vlserve import LLM
    from vlserve.bench import spec_demo

    e = s["eagle"]
    convs = spec_demo.conversations(e["num_prompts"], 4242, repeat=False)
    plain_llm, spec_llm = LLM(None), LLM(None, speculative_config={"method": "eagle", "num_speculative_tokens": 4})
    figures, heads = {}, []
    for bs in e["batch_sizes"]:
        plain, fast = spec_demo.run(plain_llm, convs, bs), spec_demo.run(spec_llm, convs, bs)
        x = fast["tok_s"] / plain["tok_s"]
        figures[f"batch {bs}"] = (f"plain {plain['tok_s']:.1f} tok/s, eagle {fast['tok_s']:.1f} tok/s, speedup "
                                  f"{x:.2f}x, acceptance {fast['acceptance']:.2f}, mean accepted length "
                                  f"{fast['mean_accepted_len']:.2f}, identical outputs {plain['ids'] == fast['ids']}")
        heads.append(f"batch {bs} {x:.2f}x")
    plain_llm.shutdown()
    spec_llm.shutdown()
    return {"figures": figures, "headline": "EAGLE " + ", ".join(heads),
            "command": f"python -m vlserve.bench.spec_demo --method eagle --num-prompts {e['num_prompts']} "
                       f"--batch-sizes {','.join(map(str, e['batch_sizes']))} (in process)"}
