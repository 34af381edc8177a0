"""Online serving benchmark: streamed chat requests with generated PNG images against any OpenAI-compatible server.

    vlserve bench serve --base-url http://127.0.0.1:8000 --model NAME --num-prompts 64 --request-rate 4
    vlserve bench serve --base-url http://127.0.0.1:8000 --model NAME --max-concurrency 16 --num-images 0

Requests arrive as a Poisson process at --request-rate per second (default: all at once), at most --max-concurrency
in flight. Prints request throughput, output tokens/s, and TTFT / inter-token latency percentiles (p50/p90/p99).
Speaks only the OpenAI HTTP API (POST /v1/chat/completions with stream=true and stream_options.include_usage).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """Timings of one streamed request."""

    ok: bool = False
    error: str = ""
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0


def make_png_data_url(width: int, height: int, rng: random.Random) -> str:
    """A random-colored PNG with a few rectangles, as a base64 data URL."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        draw.rectangle(
            [x0, y0, x0 + rng.randrange(1, width), y0 + rng.randrange(1, height)],
            fill=tuple(rng.randrange(256) for _ in range(3)),
        )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def build_messages(args, rng: random.Random) -> list[dict]:
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": make_png_data_url(args.image_width, args.image_height, rng)}}
        for _ in range(args.num_images)
    ]
    parts.append({"type": "text", "text": args.prompt})
    return [{"role": "user", "content": parts}]


async def one_request(client, args, messages: list[dict]) -> RequestResult:
    """Send one streamed chat request and time its chunks."""
    import httpx

    body = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[int, float]:
    """Nearest-rank percentiles (NaN when empty)."""
    if not values:
        return {p: float("nan") for p in ps}
    s = sorted(values)
    return {p: s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))] for p in ps}


async def run(args) -> dict:
    """Run the benchmark; returns the summary dict (also printed)."""
    import httpx

    rng = random.Random(args.seed)
    payloads = [build_messages(args, rng) for _ in range(args.num_prompts)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.max_concurrency or args.num_prompts, 1) + 4)
    sem = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"),
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(args.timeout),
        trust_env=False,
    ) as client:

        async def limited(messages):
            async with sem:
                return await one_request(client, args, messages)

        tasks = []
        start = time.perf_counter()
        for messages in payloads:
            tasks.append(asyncio.ensure_future(limited(messages)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttft = percentiles([r.ttft for r in ok if r.ttft is not None])
    itl = percentiles([x for r in ok for x in r.itls])
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_ms": {p: v * 1000 for p, v in ttft.items()},
        "itl_ms": {p: v * 1000 for p, v in itl.items()},
    }
    print(
        f"completed {len(ok)}/{len(results)} requests in {duration:.2f} s "
        f"({args.num_images} image(s) of {args.image_width}x{args.image_height} each)"
    )
    for r in results:
        if not r.ok:
            print(f"  first failure: {r.error}")
            break
    print(f"request throughput: {summary['request_throughput']:.2f} req/s")
    print(f"output throughput:  {summary['output_tokens_per_s']:.1f} tok/s ({out_tokens} tokens)")
    for name, d in (("TTFT", summary["ttft_ms"]), ("ITL", summary["itl_ms"])):
        print(f"{name:4s} ms  p50 {d[50]:8.1f}  p90 {d[90]:8.1f}  p99 {d[99]:8.1f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vlserve bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-images", type=int, default=1)
    p.add_argument("--image-width", type=int, default=224)
    p.add_argument("--image-height", type=int, default=224)
    p.add_argument("--prompt", default="Describe the image.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos extension")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    summary = asyncio.run(run(args))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
