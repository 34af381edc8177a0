"""One runner's embedding of prepared workloads, in its own process: vlserve's pooling runner (`vlserve.LLM.embed`),
vLLM's (`vllm.LLM.embed`, run by the vLLM-CPU venv's python), HF transformers or sentence-transformers.

    <python> benchmarks/pooling_child.py SPEC.json      # prints `CHILD_RESULT <json>` as its last such line

SPEC: {"runner": "vlserve" | "vllm" | "hf" | "st", "family": "qwen2_vl" | "clip", "model", "dtype" ("bfloat16" |
"float32"), "max_model_len" (Qwen2-VL's; CLIP keeps its text tower's), "hf_batch" (HF / sentence-transformers batch size), "keep" (embeddings returned per
workload, the first ones), "anchor_env" (path of vlserve/bench/anchor_env.py), "engine_kwargs" (more `LLM`
arguments), "workloads": [{"name", "sets": {"warmup" | "main": {"prompts": [str], "images": path of an .npz of
uint8 [H, W, 3] arrays "0", "1", ... (one per prompt) or null}}}]}. Qwen2-VL prompts are final text (chat template
applied, one image placeholder per image item) and pool the last token; CLIP image items have the prompt "".
Per workload: the warm-up set, then the main set timed, all of it in one call (the engines) or in batches of
hf_batch (HF, sentence-transformers); with "count_flops" (a path of benchmarks/linear_flops.py) the main set runs
under torch.profiler instead, for its linear layers' GFLOP (its time then includes the profiler's). A runner that cannot serve the family reports {"unsupported": why}.
Standard library only at import time: each runner's modules are imported by the code that runs it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback


def _load_by_path(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _images(path: str | None) -> list:
    """The set's images as PIL images, in prompt order ([] for a text set)."""
    if path is None:
        return []
    import numpy as np
    from PIL import Image

    with np.load(path) as arrays:
        return [Image.fromarray(arrays[str(i)]) for i in range(len(arrays.files))]


def _engine_inputs(prompts: list[str], images: list) -> list:
    if not images:
        return list(prompts)
    return [{"prompt": p, "multi_modal_data": {"image": img}} for p, img in zip(prompts, images)]


class EngineRunner:
    """vlserve's and vLLM's offline `LLM` in pooling mode: same call, same outputs."""

    def __init__(self, spec: dict):
        self.runner, family = spec["runner"], spec["family"]
        kwargs = dict(dtype=spec["dtype"])
        if family == "qwen2_vl":
            kwargs |= dict(max_model_len=spec["max_model_len"], runner="pooling", convert="embed")
            kwargs |= dict(limit_mm_per_prompt={"image": 1}, pooler_config={"pooling_type": "LAST"})
        elif self.runner == "vllm":  # CLIP: vlserve pools a dual tower on its own; both keep its text length
            kwargs["runner"] = "pooling"
        self.calls = None
        if self.runner == "vllm":
            from vllm import LLM

            kwargs["seed"] = 0
        else:
            from vlserve import LLM

            self.calls = _count_tower_calls(spec["model"], family)
        self.llm = LLM(spec["model"], **{**kwargs, **spec.get("engine_kwargs", {})})

    def embed(self, prompts: list[str], images: list) -> list[list[float]]:
        outs = self.llm.embed(_engine_inputs(prompts, images), use_tqdm=False)
        return [list(o.outputs.embedding) for o in outs]

    def tower_calls(self) -> tuple[int, int] | None:
        """vlserve: (the vision tower's calls, the images it encoded) so far; several images packed into one
        call count once in the first."""
        if self.calls is None:
            return None
        return self.calls[0], self.llm.engine.executor.stats().num_encoder_runs


def _count_tower_calls(model: str, family: str) -> list[int] | None:
    """Count calls of vlserve's image tower entry (`embed_multimodal`, a dual tower's `embed_image`) on the
    model's class, for this process's engine: a one-element list that each call increments."""
    import functools

    from transformers import AutoConfig

    from vlserve.models.registry import get_model_class

    cls = get_model_class(AutoConfig.from_pretrained(model))
    name = "embed_multimodal" if family == "qwen2_vl" else "embed_image"
    method = getattr(cls, name, None)
    if method is None:
        return None
    calls = [0]

    @functools.wraps(method)
    def counted(*args, **kwargs):
        calls[0] += 1
        return method(*args, **kwargs)

    setattr(cls, name, counted)
    return calls


class HfRunner:
    """transformers on the same checkpoint: Qwen2-VL's base model (last token of the final normed hidden states,
    prompts left-padded) or CLIPModel's get_image_features / get_text_features; L2-normalized."""

    def __init__(self, spec: dict):
        import torch
        from transformers import AutoModel, AutoProcessor

        self.torch, self.family, self.batch = torch, spec["family"], spec["hf_batch"]
        self.processor = AutoProcessor.from_pretrained(spec["model"])
        if self.family == "qwen2_vl":
            self.processor.tokenizer.padding_side = "left"
        dtype = getattr(torch, spec["dtype"])
        self.model = AutoModel.from_pretrained(spec["model"], dtype=dtype).eval()

    def embed(self, prompts: list[str], images: list) -> list[list[float]]:
        rows = []
        with self.torch.inference_mode():
            for i in range(0, len(prompts), self.batch):
                batch_images = images[i : i + self.batch] or None
                rows.append(self._embed_batch(prompts[i : i + self.batch], batch_images))
        vectors = self.torch.cat(rows).float()  # [N, D]
        return self.torch.nn.functional.normalize(vectors, dim=-1).tolist()

    def _embed_batch(self, prompts: list[str], images: list | None):
        if self.family == "qwen2_vl":
            inputs = self.processor(text=prompts, images=images, padding=True, return_tensors="pt")
            return self.model(**inputs).last_hidden_state[:, -1]  # [B, H]
        if images:
            pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.model.dtype)
            return _features(self.model.get_image_features(pixel_values=pixels))
        inputs = self.processor(text=prompts, padding=True, return_tensors="pt")
        return _features(self.model.get_text_features(**inputs))

    def tower_calls(self) -> None:
        return None


def _features(output):
    """get_*_features' result: a tensor, or (transformers 5) an output whose pooler_output is the projection."""
    return output if hasattr(output, "shape") else output.pooler_output


class SentenceTransformersRunner:
    """sentence-transformers on the same checkpoint: for CLIP its own CLIP support (bare images and texts); for
    Qwen2-VL a Transformer module that hands the final prompt strings (and images) to the processor as they are
    (no chat template of its own), last-token pooling of the left-padded batch, normalized."""

    def __init__(self, spec: dict):
        import torch
        from sentence_transformers import SentenceTransformer

        self.family, self.batch = spec["family"], spec["hf_batch"]
        dtype = getattr(torch, spec["dtype"])
        if self.family == "clip":
            self.model = SentenceTransformer(spec["model"], device="cpu", model_kwargs={"dtype": dtype})
            return
        from sentence_transformers.base.modules.normalize import Normalize
        from sentence_transformers.base.modules.transformer import Transformer
        from sentence_transformers.sentence_transformer.modules.pooling import Pooling

        plain = {"method": "forward", "method_output_name": "last_hidden_state"}  # no "message": no chat template
        body = Transformer(
            spec["model"],
            model_kwargs={"dtype": dtype},
            modality_config={"text": plain, ("image", "text"): plain},
            module_output_name="token_embeddings",
            unpad_inputs=False,
        )
        body.processor.tokenizer.padding_side = "left"
        pooling = Pooling(body.get_embedding_dimension(), pooling_mode="lasttoken")
        self.model = SentenceTransformer(modules=[body, pooling, Normalize()], device="cpu")

    def embed(self, prompts: list[str], images: list) -> list[list[float]]:
        if self.family == "clip":
            items = images or prompts
        else:
            items = [{"text": p, "image": img} for p, img in zip(prompts, images)] if images else prompts
        vectors = self.model.encode(items, batch_size=self.batch, convert_to_tensor=True, normalize_embeddings=True)
        return vectors.float().tolist()

    def tower_calls(self) -> None:
        return None


RUNNERS = {"vlserve": EngineRunner, "vllm": EngineRunner, "hf": HfRunner, "st": SentenceTransformersRunner}


def run(spec: dict) -> dict:
    """Load the runner, then per workload a warm-up and the timed pass; the first `keep` embeddings of each."""
    anchor_env = _load_by_path("anchor_env", spec["anchor_env"])
    t0 = time.perf_counter()
    try:
        runner = RUNNERS[spec["runner"]](spec)
    except Exception as e:  # a runner without this family (e.g. a build before CLIP pooling) fails to load
        traceback.print_exc()  # into the log
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        if spec["runner"] == "vlserve" and spec["family"] == "clip" and isinstance(e, ValueError):
            why = f"CLIP not served by this build ({why})"
        return {"unsupported": why}
    result = {"load_s": time.perf_counter() - t0, "cores": anchor_env.process_tree_cores(), "workloads": {}}
    import torch

    result["cores"]["torch threads (this process)"] = torch.get_num_threads()
    for w in spec["workloads"]:
        sets = {name: (s["prompts"], _images(s["images"])) for name, s in w["sets"].items()}
        runner.embed(*sets["warmup"])
        before = runner.tower_calls()
        if spec.get("count_flops"):  # the main set's first pass (a second would hit the prefix and encoder caches)
            counted = _load_by_path("linear_flops", spec["count_flops"]).profile_linears(
                lambda: runner.embed(*sets["main"])
            )
            vectors, seconds = counted["result"], counted["wall_s"]
        else:
            t = time.perf_counter()
            vectors = runner.embed(*sets["main"])
            seconds = time.perf_counter() - t
        after = runner.tower_calls()
        items = len(sets["main"][0])
        assert len(vectors) == items, (len(vectors), items)
        result["workloads"][w["name"]] = {
            "items": items,
            "seconds": seconds,
            "items_per_s": items / seconds,
            "dim": len(vectors[0]),
            "tower_calls": None if after is None else after[0] - before[0],
            "images_encoded": None if after is None else after[1] - before[1],
            "first": vectors[: spec["keep"]],
        }
        if spec.get("count_flops"):
            result["workloads"][w["name"]]["linear_gflop"] = counted["linear_gflop"]
        print(f"# {spec['runner']} {w['name']}: {items} items in {seconds:.3f} s", flush=True)
    return result


if __name__ == "__main__":  # vLLM spawns its engine core: this file must be importable without side effects
    with open(sys.argv[1]) as f:
        print("CHILD_RESULT " + json.dumps(run(json.load(f))), flush=True)
