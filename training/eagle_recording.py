"""EAGLE training inputs: the JSONL items (`read_items`) and the target's own hidden states.

`record_target` runs the target through the vlserve engine with `HiddenStateRecorder` in the proposer slot; it keeps,
per request and position, what the draft reads there (see `train_eagle`'s docstring, step 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch


def read_items(path: str) -> list[dict]:
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(item, dict) or not (
                isinstance(item.get("prompt"), str)
                or isinstance(item.get("messages"), list)
                or isinstance(item.get("prompt_token_ids"), list)
            ):
                raise ValueError(
                    f'{path}:{n}: expected {{"prompt": str}}, {{"messages": [...]}} or {{"prompt_token_ids": [...]}}'
                )
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def generate_items(llm, items: list[dict], sp, use_tqdm: bool):
    """Run prompts through llm.generate and conversations through llm.chat; outputs in item order."""
    out: list = [None] * len(items)
    prompts = [
        (i, it["prompt"] if "prompt" in it else list(it["prompt_token_ids"]))
        for i, it in enumerate(items)
        if "messages" not in it
    ]
    chats = [(i, it["messages"]) for i, it in enumerate(items) if "messages" in it]
    if prompts:
        for (i, _), o in zip(prompts, llm.generate([p for _, p in prompts], sp, use_tqdm=use_tqdm)):
            out[i] = o
    if chats:
        for (i, _), o in zip(chats, llm.chat([c for _, c in chats], sp, use_tqdm=use_tqdm)):
            out[i] = o
    return out


@dataclass
class Sequence:
    """One recorded sequence, rows = positions 0..n-1 (n = tokens - 1)."""

    hidden: torch.Tensor  # [n, Hin] the states the draft reads at p
    embeds: torch.Tensor  # [n, H] embedding of token p+1 (media merged)
    final: torch.Tensor  # [n, H] the target's final normed hidden at p (its logits at p -> token p+1)
    positions: torch.Tensor  # [n] or [3, n]


class HiddenStateRecorder:
    """Sits in the runner's proposer slot (no drafts): records the target's states per request and position."""

    uses_target_hidden_states = True

    def __init__(self, aux_layer_ids: list[int], method: str, embed_fn):
        self.aux_layer_ids = list(aux_layer_ids)
        self.method = method
        self.embed_fn = embed_fn
        self.rows: dict[str, dict[str, list]] = {}

    def draft_kv_spec(self) -> None:
        return None

    def remove_requests(self, req_ids) -> None:
        pass

    def select_hidden(self, hidden, aux):
        if self.method == "eagle3":
            return hidden, torch.cat(aux, dim=-1)
        return hidden, (aux[0] if self.aux_layer_ids else hidden)

    @torch.inference_mode()
    def propose_drafts(self, inp) -> dict[str, list[int]]:
        final, feats = self.select_hidden(inp.hidden_states, inp.aux_hidden_states)
        embeds = inp.inputs_embeds if inp.inputs_embeds is not None else self.embed_fn(inp.input_ids)
        cu = inp.attn_metadata.query_start_loc_cpu
        for i, rid in enumerate(inp.batch_req_ids):
            n = int(inp.batch_num_valid[i])
            if n <= 0:
                continue
            lo, s = cu[i], int(inp.batch_starts[i])
            rec = self.rows.setdefault(rid, {})
            pos = inp.positions[..., lo : lo + n].cpu()
            f, e, fi = (x[lo : lo + n].float().cpu() for x in (feats, embeds, final))
            for j in range(n):  # a preempted request recomputes: later rows overwrite earlier ones
                rec[s + j] = (f[j], e[j], fi[j], pos[..., j])
        return {}

    def sequences(self) -> list[Sequence]:
        out = []
        for rec in self.rows.values():
            n = max(rec) + 1
            if len(rec) != n or n < 3:
                continue  # incomplete (should not happen without prefix caching) or too short to train on
            rows = [rec[p] for p in range(n)]
            hid, emb, fin, pos = (torch.stack([r[c] for r in rows], dim=-1 if c == 3 else 0) for c in range(4))
            out.append(Sequence(hid, emb, fin, pos))
        return out


def record_target(
    target: str, items: list[dict], gen_len: int, method: str, layer_ids: list[int], args
) -> tuple[list[Sequence], list[list[int]]]:
    from vlserve import LLM, SamplingParams
    from vlserve.models.llama import decoder_of

    llm = LLM(
        target,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
    )
    model = llm.engine.runner.model
    rec = HiddenStateRecorder(layer_ids, method, decoder_of(model).embed_tokens)
    llm.engine.runner.set_proposer(rec)
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=args.ignore_eos)
    outs = generate_items(llm, items, sp, use_tqdm=not args.quiet)
    llm.engine.runner.set_proposer(None)
    return rec.sequences(), [list(o.outputs[0].token_ids) for o in outs]
