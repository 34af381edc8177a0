"""`benchmarks.realsize`'s rows (one per workload, dtype and engine) and its table."""

from __future__ import annotations

from benchmarks.anchors import ENGINE_LABELS

ANCHORS = ("vllm", "openvino")


def check_counts(result: dict, prompt_lens: list[int], max_tokens: int) -> str:
    """ "ok" when the engine saw the prompts at the expected token counts and generated exactly max_tokens each
    (one in the max_tokens=1 pass), and the whole call's count where the engine reports only that; otherwise what
    differed."""
    problems = []
    if result["output_tokens"] != [max_tokens] * len(prompt_lens):
        problems.append(f"output tokens {sorted(set(result['output_tokens']))} != {max_tokens}")
    batch = result.get("batch_output_tokens")
    if batch is not None and batch != max_tokens * len(prompt_lens):
        problems.append(f"the call generated {batch} tokens, not {max_tokens} x {len(prompt_lens)}")
    if any(n != 1 for n in result["ttft_pass_output_tokens"]):
        problems.append("max_tokens=1 pass gave other than 1 token")
    if result["prompt_tokens"] != prompt_lens:
        problems.append(f"prompt tokens {result['prompt_tokens']} != {prompt_lens}")
    return "ok" if not problems else "; ".join(problems)


def result_rows(results: dict, workloads: dict, work: dict, limits, labels: dict | None = None) -> list[dict]:
    """Per (workload, dtype, engine): rates, TTFT, the ratio to the faster anchor and the fraction of the ideal
    time. `results`: (dtype, engine) -> the child's result or why it has none; `work`: (workload, dtype) ->
    WorkloadWork; `labels`: engine -> its row's name (default ENGINE_LABELS)."""
    labels = {**ENGINE_LABELS, **(labels or {})}
    rows = []
    for name, w in workloads.items():
        for dtype in dict.fromkeys(d for d, _ in results):
            ideal = work[(name, dtype)].ideal(limits, dtype)
            group = []
            for (d, engine), r in results.items():
                if d != dtype:
                    continue
                row = {"workload": name, "dtype": dtype, "engine": engine, "label": labels[engine], "ideal": ideal}
                if not isinstance(r, dict) or name not in r["workloads"]:
                    row["error"] = r if isinstance(r, str) else "no result"
                    group.append(row)
                    continue
                m = r["workloads"][name]
                decode_s = m["total_s"] - m["ttft_pass_s"]
                row.update(
                    req_s=w.requests / m["total_s"],
                    total_s=m["total_s"],
                    ttft_s=m["ttft_pass_s"],
                    engine_mean_ttft_s=m["engine_mean_ttft_s"],
                    decode_tok_s=w.requests * (w.max_tokens - 1) / decode_s if decode_s > 0 else None,
                    fraction={
                        "first_tokens": ideal["first_tokens_s"] / m["ttft_pass_s"],
                        "decode": ideal["decode_s"] / decode_s if decode_s > 0 else None,
                        "total": ideal["total_s"] / m["total_s"],
                    },
                    counts=check_counts(m, w.prompt_lens, w.max_tokens),
                )
                group.append(row)
            anchor_rates = [r["req_s"] for r in group if r["engine"] in ANCHORS and "req_s" in r]
            for row in group:
                if anchor_rates and "req_s" in row:
                    row["vs_faster_anchor"] = row["req_s"] / max(anchor_rates)
            rows.extend(group)
    return rows


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    """A markdown table: req/s, TTFT, decode tok/s, the ratio to the faster anchor, ideal seconds and fractions."""
    lines = [
        "| workload | dtype | engine | req/s | TTFT s (max_tokens=1 pass) | engine's mean TTFT s | decode tok/s "
        "| vs faster anchor | ideal s: first tokens / decode / total | fraction of ideal: first / decode / total "
        "| token counts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ideal = r["ideal"]
        ideal_s = f"{ideal['first_tokens_s']:.3f} / {ideal['decode_s']:.3f} / {ideal['total_s']:.3f}"
        head = f"| {r['workload']} | {r['dtype']} | {r['label']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | {ideal_s} | | |")
            continue
        fr = r["fraction"]
        fractions = " / ".join(_f(fr[k], ".0%") for k in ("first_tokens", "decode", "total"))
        lines.append(
            f"{head} {r['req_s']:.3f} | {r['ttft_s']:.3f} | {_f(r['engine_mean_ttft_s'], '.3f')} | "
            f"{_f(r['decode_tok_s'], '.1f')} | {_f(r.get('vs_faster_anchor'), '.2f')}"
            f"{'x' if r.get('vs_faster_anchor') else ''} | {ideal_s} | {fractions} | {r['counts']} |"
        )
    return "\n".join(lines)
