"""Scoring query / document pairs on a pooling engine, one piece for `LLM.score` and the HTTP score / rerank
endpoints: which prompts to pool for the pairs (`plan_scores`) and the scores from their results
(`scores_from_outputs`).

Each side is a string, a list of strings, or vLLM's multimodal shape (`ScoreMultiModalParam`): one
`{"content": [parts]}` dict, each of whose parts is an input of its own, or a list whose entries are strings or
`{"content": [parts]}` dicts (one input each). Parts are OpenAI content parts (`text`, `image_url`, ...). One query
scores against every document (1:N), or queries and documents pair up (N:N).

A classifier (task "score") pools each pair once: two strings as the tokenizer's text pair; otherwise one user
message whose content is the query's parts then the document's, rendered by the chat template with a generation
prompt. An embedder (task "embed") embeds each distinct side once (a string as a plain prompt, content as one user
message through the chat template) and scores a pair by the cosine of its two embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlserve.engine.chat import default_media_source
from vlserve.engine.input_processor import ChatTemplateOptions, InputProcessor, ProcessedPrompt
from vlserve.engine.request_limits import check_prompt_chars
from vlserve.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput
from vlserve.shorten import shorten

ScoreInput = str | list[dict]  # a string, or one input's content parts


@dataclass(frozen=True)
class TextPrompt:
    """A plain text prompt (tokenized with the tokenizer's special tokens)."""

    text: str


@dataclass(frozen=True)
class TextPairPrompt:
    """Two texts tokenized together as the tokenizer's text pair (a cross-encoder's input)."""

    first: str
    second: str


@dataclass(frozen=True)
class ChatPrompt:
    """One user message of content parts, rendered by the chat template with a generation prompt."""

    parts: tuple[dict, ...]

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": list(self.parts)}]


ScorePrompt = TextPrompt | TextPairPrompt | ChatPrompt


@dataclass
class ScorePlan:
    """What to pool for a score call: `task` ("score": a classifier pools each pair; "embed": each side is
    embedded), the `prompts` in pooling order, and per pair the indices of the prompts it reads (one for a
    classifier, query then document for an embedder)."""

    task: str
    prompts: list[ScorePrompt]
    pairs: list[tuple[int, ...]]


def score_inputs(data: Any, name: str) -> list[ScoreInput]:
    """One side of a score call as a list of inputs (strings or content-part lists); ValueError naming `name`
    when it is not a string, a `{"content": [parts]}` dict, or a list of those."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):  # vLLM's ScoreMultiModalParam: each of its parts is one input
        return [[part] for part in _content_of(data, name)]
    if not isinstance(data, (list, tuple)):
        raise ValueError(
            f"{name} must be a string, a list, or a {{'content': [...]}} object, got {type(data).__name__}"
        )
    inputs: list[ScoreInput] = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            inputs.append(item)
        elif isinstance(item, dict):
            inputs.append(_content_of(item, f"{name}[{i}]"))
        else:
            raise ValueError(
                f"{name}[{i}] must be a string or a {{'content': [...]}} object, got {type(item).__name__}"
            )
    return inputs


def _content_of(item: dict, name: str) -> list[dict]:
    unknown = sorted(set(item) - {"content"})
    if unknown:
        raise ValueError(
            f"{name}: unknown keys {[shorten(k) for k in unknown]}; a multimodal input is {{'content': [parts]}}"
        )
    parts = item.get("content")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) and "type" in p for p in parts):
        raise ValueError(f"{name}.content must be a non-empty list of content parts ({{'type': ...}})")
    return list(parts)


def plan_scores(data_1: Any, data_2: Any, tasks: set[str], names: tuple[str, str] = ("data_1", "data_2")) -> ScorePlan:
    """The prompts and pairs for scoring `data_1` (queries) against `data_2` (documents) on an engine serving
    `tasks`; ValueError on bad inputs, mismatched lengths, or an engine that neither classifies nor embeds."""
    queries, docs = score_inputs(data_1, names[0]), score_inputs(data_2, names[1])
    if not queries or not docs:
        raise ValueError(f"{names[0] if not queries else names[1]} must not be empty")
    if len(queries) != 1 and len(queries) != len(docs):
        raise ValueError(
            f"{names[0]} must hold one input or as many as {names[1]} (1:N or N:N), got {len(queries)} and {len(docs)}"
        )
    if len(queries) == 1:
        queries = queries * len(docs)
    if "score" in tasks:
        prompts = [_pair_prompt(q, d) for q, d in zip(queries, docs)]
        return ScorePlan("score", prompts, [(i,) for i in range(len(prompts))])
    if "embed" in tasks:
        prompts: list[ScorePrompt] = []
        index: dict[ScorePrompt, int] = {}
        pairs = []
        for q, d in zip(queries, docs):
            pair = []
            for side in (q, d):
                prompt = _side_prompt(side)
                if prompt not in index:
                    index[prompt] = len(prompts)
                    prompts.append(prompt)
                pair.append(index[prompt])
            pairs.append(tuple(pair))
        return ScorePlan("embed", prompts, pairs)
    raise ValueError(f"this engine does not score; it serves {sorted(tasks) or 'generation'}")


def _parts(side: ScoreInput) -> list[dict]:
    return [{"type": "text", "text": side}] if isinstance(side, str) else side


def _pair_prompt(query: ScoreInput, doc: ScoreInput) -> ScorePrompt:
    if isinstance(query, str) and isinstance(doc, str):
        return TextPairPrompt(query, doc)
    return ChatPrompt(_frozen_parts(_parts(query) + _parts(doc)))


def _side_prompt(side: ScoreInput) -> ScorePrompt:
    return TextPrompt(side) if isinstance(side, str) else ChatPrompt(_frozen_parts(side))


class _Part(dict):
    """A content part that hashes by its content (so equal inputs are pooled once)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(repr(sorted(self.items(), key=lambda kv: kv[0])))


def _frozen_parts(parts: list[dict]) -> tuple[dict, ...]:
    return tuple(_Part(p) for p in parts)


SCORE_CHAT_OPTIONS = ChatTemplateOptions(add_generation_prompt=True)


def process_text_pair(processor: InputProcessor, prompt: TextPairPrompt) -> ProcessedPrompt:
    """The pair through the tokenizer as one text pair (its special tokens and separators)."""
    for text in (prompt.first, prompt.second):
        check_prompt_chars(text, processor.max_prompt_chars, processor.loaded.max_model_len)
    ids = processor.tokenizer(prompt.first, prompt.second)["input_ids"]
    return ProcessedPrompt(None, list(ids), [])


def process_score_prompt(
    processor: InputProcessor, prompt: ScorePrompt, mm_processor_kwargs=None, dual_tower: bool = False
) -> ProcessedPrompt:
    """A score prompt processed in this process (media as the offline chat takes them: data: / file: URLs, paths,
    in-memory images); content for a `dual_tower` model is its one text or image (`dual_tower_prompt`)."""
    if isinstance(prompt, TextPairPrompt):
        return process_text_pair(processor, prompt)
    if isinstance(prompt, TextPrompt):
        return processor.process_prompt(prompt.text, mm_processor_kwargs=mm_processor_kwargs)
    if dual_tower:
        single = dual_tower_prompt(list(prompt.parts), default_media_source)
        return processor.process_prompt(single, mm_processor_kwargs=mm_processor_kwargs)
    return processor.process_chat(prompt.messages(), mm_processor_kwargs, options=SCORE_CHAT_OPTIONS)


def is_dual_tower(hf_config) -> bool:
    """Whether the checkpoint is a dual-tower embedder (ModelCapabilities.dual_tower: CLIP, SigLIP)."""
    from vlserve.models.capabilities import model_capabilities
    from vlserve.models.registry import get_model_class

    return bool(model_capabilities(get_model_class(hf_config), hf_config).dual_tower)


def scores_from_outputs(plan: ScorePlan, outputs: list[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
    """One ScoringRequestOutput per pair from the pooled results of `plan.prompts` (in order): a classifier's
    last output, or the cosine of the pair's two embeddings (its prompt ids: the query's then the document's)."""
    if len(outputs) != len(plan.prompts):
        raise ValueError(f"got {len(outputs)} pooled outputs for {len(plan.prompts)} prompts")
    results = []
    for n, pair in enumerate(plan.pairs):
        if plan.task == "score":
            out = outputs[pair[0]]
            results.append(
                ScoringRequestOutput(out.request_id, ScoringOutput(float(out.outputs.data[-1])), out.prompt_token_ids)
            )
            continue
        q, d = outputs[pair[0]], outputs[pair[1]]
        cosine = torch.nn.functional.cosine_similarity(q.outputs.data.float(), d.outputs.data.float(), dim=-1)
        results.append(
            ScoringRequestOutput(str(n), ScoringOutput(float(cosine)), q.prompt_token_ids + d.prompt_token_ids)
        )
    return results


def dual_tower_prompt(parts: list[dict], media_source) -> dict:
    """A dual-tower (CLIP / SigLIP) embedder's prompt from one input's content parts: exactly one text part ->
    `{"prompt": text}`, exactly one image part -> `{"prompt": "", "multi_modal_data": {"image": item}}` (the
    item from `media_source(part_type, part)`); ValueError otherwise (a dual tower embeds one text or one image)."""
    if len(parts) != 1 or not isinstance(parts[0], dict):
        raise ValueError(f"a dual-tower embedder takes one text or one image per input, got {len(parts)} parts")
    part = parts[0]
    ptype = part.get("type")
    if ptype == "text":
        if not isinstance(part.get("text"), str) or not part["text"]:
            raise ValueError("a text part needs a non-empty 'text' string")
        return {"prompt": part["text"]}
    if ptype in ("image_url", "image_pil", "image"):
        return {"prompt": "", "multi_modal_data": {"image": media_source(ptype, part)}}
    raise ValueError(f"a dual-tower embedder takes text or image parts, got {shorten(ptype)}")
