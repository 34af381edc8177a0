"""The pooling engine's front-end side: which runner a checkpoint gets (`resolve_pooler_spec`, reading the
sentence-transformers files beside it), the checks a pooling request passes, and the step from a pooled tensor to
the result a request asked for (`finish_pooled`: Matryoshka truncation, normalization, the classifier's
activation)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

from vlserve.config import EngineArgs
from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import EngineCoreOutput
from vlserve.models.capabilities import model_capabilities
from vlserve.models.hf_config import architectures_of
from vlserve.models.registry import get_model_class
from vlserve.outputs import PoolingOutput, PoolingRequestOutput
from vlserve.pooling_params import PoolerConfig, PoolerSpec, PoolingParams
from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten

# what a pooling request's EngineCoreRequest carries for the core's limits: one position past the prompt, never used
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, detokenize=False)
POOLING_ENCODER_BUDGET = 8192  # embeddings a pooling engine's step may encode (the default encoder cache's size)

_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
# sentence-transformers 6 writes one `pooling_mode` string instead of the boolean keys above
_ST_POOLING_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}


def _st_pooling_type(config: dict, config_file: str) -> str:
    """The pooling type a sentence-transformers Pooling config names (either layout); ValueError for another mode."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        if mode not in _ST_POOLING_MODE_NAMES:
            raise ValueError(
                f"{config_file}: pooling_mode must be one of {sorted(_ST_POOLING_MODE_NAMES)}, got {mode!r}"
            )
        return _ST_POOLING_MODE_NAMES[mode]
    modes = [name for key, name in _ST_POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{config_file}: exactly one of {sorted(_ST_POOLING_MODES)} must be true")
    return modes[0]


def sentence_transformers_pooling(model_path: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from the checkpoint's sentence-transformers `modules.json` and its Pooling
    module's `config.json` (the module types of sentence-transformers 2-5, `...models.Pooling`, and 6,
    `...modules.pooling.Pooling`); (None, None) when it has none."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_file):
        return None, None
    with open(modules_file) as f:
        modules = json.load(f)
    pooling_type, normalize = None, False
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config_file = os.path.join(model_path, module.get("path", ""), "config.json")
            if os.path.isfile(config_file):
                with open(config_file) as f:
                    pooling_type = _st_pooling_type(json.load(f), config_file)
    return pooling_type, normalize


def sentence_transformers_max_seq_length(model_path: str, tokenizer) -> int | None:
    """The longest input a sentence-transformers checkpoint embeds: `max_seq_length` of its
    `sentence_bert_config.json` (sentence-transformers 2-5), else its tokenizer's `model_max_length` (where 6 keeps
    it); None for a checkpoint without `modules.json` or without either bound."""
    if not os.path.isfile(os.path.join(model_path, "modules.json")):
        return None
    config_file = os.path.join(model_path, "sentence_bert_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            length = json.load(f).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            return length
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < 1_000_000 else None  # unset: transformers' 1e30


def resolve_pooler_spec(args: EngineArgs, hf_config, tokenizer, model_path: str) -> PoolerSpec | None:
    """The engine's pooler, or None for a generation engine. `runner="auto"` pools when `convert` asks for it, the
    architecture is a `*ForSequenceClassification` or the model is encoder-only (`kv_free`: BERT); settings come
    from `pooler_config`, then the checkpoint's sentence-transformers files, then the default pooling (CLS for an
    encoder-only model, else LAST)."""
    arch = architectures_of(hf_config)[0][0]
    classification_arch = arch.endswith("ForSequenceClassification")
    caps = model_capabilities(get_model_class(hf_config), hf_config)
    config: PoolerConfig = args.pooler_config
    if args.runner == "generate" or (
        args.runner == "auto"
        and args.convert not in ("embed", "classify")
        and not classification_arch
        and not caps.kv_free  # a model with no decoder only pools
    ):
        return None
    if args.convert in ("embed", "classify"):
        task = args.convert
    else:
        task = "classify" if classification_arch or config.classifier_from_token else "embed"
    if caps.kv_free and config.classifier_from_token:
        raise ValueError(f"{arch} has no LM head to take classifier_from_token rows from")
    if caps.dual_tower and (task != "embed" or config.pooling_type is not None):
        raise ValueError(
            f"{arch} is a dual-tower embedder: it embeds (convert='embed') and pools as its family does "
            "(no pooler_config pooling_type)"
        )
    st_type, st_normalize = sentence_transformers_pooling(model_path)
    pooling_type = config.pooling_type or st_type or ("CLS" if caps.kv_free and not caps.dual_tower else "LAST")
    default_normalize = task == "embed" and (st_normalize if st_normalize is not None else True)
    normalize = config.normalize if config.normalize is not None else default_normalize
    token_ids: tuple[int, ...] = ()
    if config.classifier_from_token:
        if task != "classify":
            raise ValueError("pooler_config classifier_from_token needs convert='classify'")
        token_ids = tuple(_token_id(tokenizer, t) for t in config.classifier_from_token)
    text_config = hf_config.get_text_config()
    dims = getattr(hf_config, "matryoshka_dimensions", None) or getattr(text_config, "matryoshka_dimensions", None)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(text_config, "is_matryoshka", False))
    return PoolerSpec(
        pooling_type,
        bool(normalize),
        task,
        token_ids,
        tuple(int(d) for d in dims) if dims else None,
        matryoshka or bool(dims),
    )


def _token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"classifier_from_token: {token!r} is not one token of this tokenizer")
    return int(token_id)


def pooling_engine_args(args: EngineArgs, spec: PoolerSpec | None, kv_free: bool = False) -> EngineArgs:
    """`args` as a pooling engine runs them: ValueError on what it cannot do; prefix caching off unless the
    pooling reads the last token only (a cached prefix has no hidden states to pool), and always for a `kv_free`
    model (it keeps no KV to reuse); unless the user set one, a fixed encoder budget of the encoder cache's size, so
    a step's images share one tower call (the budget sized in time keeps decode steps short, and a pooling engine
    has none)."""
    if spec is None:
        return args
    for name, value in (
        ("async_scheduling", args.async_scheduling),
        ("speculative_config", args.speculative_config),
        ("mm_encoder_only", args.mm_encoder_only),
        ("kv_transfer_config", args.kv_transfer_config),
    ):
        if value:
            raise ValueError(f"a pooling engine (runner='pooling') cannot run with {name}")
    if args.pipeline_parallel_size > 1:
        raise ValueError("a pooling engine runs without pipeline parallelism for now")
    if kv_free and args.enable_lora:
        raise ValueError("a model with no decoder (kv_free) runs without LoRA adapters")
    if (spec.pooling_type != "LAST" or kv_free) and args.enable_prefix_caching:
        args = replace(args, enable_prefix_caching=False)
    if args.max_num_encoder_input_tokens is None:  # no decode steps to keep short: a step encodes all it can hold
        args = replace(args, max_num_encoder_input_tokens=args.encoder_cache_size or POOLING_ENCODER_BUDGET)
    return args


def check_pooling_params(params: PoolingParams, spec: PoolerSpec | None, hidden_size: int) -> None:
    """ValueError when `params` are invalid or ask what this engine does not serve."""
    if spec is None:
        raise ValueError("this engine generates text; pooling requests need runner='pooling' (--runner pooling)")
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    params.verify()
    if params.task not in spec.supported_tasks:
        raise ValueError(f"task {params.task!r} is not served by this model; it serves {sorted(spec.supported_tasks)}")
    d = params.dimensions
    if d is not None:
        if not spec.is_matryoshka:
            raise ValueError("dimensions is supported by Matryoshka models only (is_matryoshka in the config)")
        if spec.matryoshka_dimensions is not None and d not in spec.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(spec.matryoshka_dimensions)}, got {d}")
        if d > hidden_size:
            raise ValueError(f"dimensions {d} exceeds the embedding size {hidden_size}")


def finish_pooled(data: torch.Tensor, params: PoolingParams, spec: PoolerSpec) -> torch.Tensor:
    """The pooled float32 tensor as `params` ask: embed / encode truncated to `dimensions` and L2-normalized
    (default: the pooler's setting for embed, off for encode); classify / score through the activation (sigmoid
    for one label, softmax over several; default on)."""
    if params.task in ("embed", "encode"):
        if params.dimensions is not None:
            data = data[..., : params.dimensions]
        normalize = params.normalize if params.normalize is not None else spec.normalize and params.task == "embed"
        return torch.nn.functional.normalize(data, dim=-1) if normalize else data
    if params.activation is False:
        return data
    return torch.sigmoid(data) if data.shape[-1] == 1 else torch.softmax(data, dim=-1)


class PoolingRequests:
    """A front end's open pooling requests (`EngineLoop`, or the API side of the engine process): checks them,
    makes their engine requests, and turns their finished core outputs into PoolingRequestOutputs."""

    def __init__(self, spec: PoolerSpec | None, hidden_size: int):
        self.spec = spec
        self.hidden_size = hidden_size
        self.open: dict[str, tuple[PoolingParams, list[int]]] = {}  # id -> (params, prompt token ids)

    def engine_requests(self, requests, input_processor, in_use) -> list[EngineCoreRequest]:
        """Check `requests` (NewRequests with PoolingParams; ValueError on bad params or an id `in_use` or open)
        and make their engine requests, which pool (`pools=True`)."""
        seen: set[str] = set()
        for r in requests:
            check_pooling_params(r.params, self.spec, self.hidden_size)
            if input_processor.dual_tower is not None:  # one text or one image, however the prompt was made
                input_processor.dual_tower.check_prompt(r.processed.prompt_token_ids, r.processed.mm_features)
            if in_use(r.request_id) or r.request_id in self.open or r.request_id in seen:
                raise ValueError(f"request id {shorten(r.request_id)} is already in use")
            seen.add(r.request_id)
        return [
            replace(
                input_processor.make_engine_request(
                    r.request_id, r.processed, POOLING_SAMPLING_PARAMS, r.arrival, r.lora_request, r.priority
                ),
                pools=True,
            )
            for r in requests
        ]

    def track(self, request) -> None:
        """Open a request (a NewRequest the core accepted or was sent)."""
        self.open[request.request_id] = (request.params, list(request.processed.prompt_token_ids))

    def split(self, outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[PoolingRequestOutput]]:
        """(the generation outputs, the finished pooling requests' results) of one step's core outputs."""
        if not self.open:
            return outputs, []
        mine = [o for o in outputs if o.request_id in self.open]
        if not mine:
            return outputs, []
        rest = [o for o in outputs if o.request_id not in self.open]
        return rest, [self._result(o) for o in mine if o.finished]

    def _result(self, out: EngineCoreOutput) -> PoolingRequestOutput:
        """A finished request's result as its params ask (an aborted one's data is empty)."""
        params, prompt_ids = self.open.pop(out.request_id)
        data = torch.empty(0) if out.pooling_output is None else finish_pooled(out.pooling_output, params, self.spec)
        return PoolingRequestOutput(out.request_id, PoolingOutput(data), prompt_ids, True, out.num_cached_tokens)
