"""Front-end input processing: prompts and chat messages -> token ids (+ processed media) -> EngineCoreRequest."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from vlserve.core.request import EngineCoreRequest
from vlserve.engine.chat import (
    CONTENT_FORMATS,
    default_media_source,
    parse_chat_messages,
    resolve_content_format,
    to_content_format,
)
from vlserve.engine.logits_fields import bind_logits_fields
from vlserve.engine.model_setup import LoadedModel
from vlserve.engine.request_limits import check_prompt_chars, max_prompt_chars
from vlserve.lora.peft_checkpoint import adapter_targets_encoder
from vlserve.multimodal.dual_tower_items import DualTowerProcessor, single_part
from vlserve.multimodal.inputs import MultiModalFeature, feature_from_remote
from vlserve.multimodal.media_refs import ImageEmbeds
from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten

_PLACEHOLDERS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "audio": "<|AUDIO|>"}


@dataclass
class ProcessedPrompt:
    """A prompt after tokenization and media processing."""

    prompt: str | None
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share cached KV


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How messages become a prompt (vLLM's chat options): open an assistant turn after them
    (`add_generation_prompt`), or leave the final message open for the model to continue it
    (`continue_final_message`; not both), and whether the tokenizer adds its special tokens (BOS) to the rendered
    text (`add_special_tokens`; templates usually write them)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {shorten(getattr(self, name))}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "message or open a new assistant turn (send add_generation_prompt=false with it)"
            )


def check_cache_salt(salt: Any) -> str | None:
    """The salt as given (None: no salt); ValueError unless a non-empty string (vLLM's rule)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string if given")
    return salt


class InputProcessor:
    """Tokenizes prompts, applies the chat template, runs the HF processor on media, validates limits."""

    def __init__(
        self,
        loaded: LoadedModel,
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
        structured_outputs_config: Any = None,
    ):
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {shorten(chat_template_content_format)}"
            )
        self.chat_template_content_format = chat_template_content_format
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.limit_mm_per_prompt = dict(limit_mm_per_prompt or {})
        self.default_mm_kwargs = dict(mm_processor_kwargs or {})
        self.mm_processor = getattr(loaded, "mm_processor", None)
        if self.default_mm_kwargs.get("video_pruning_rate") and not getattr(self.mm_processor, "prunes_videos", False):
            raise ValueError("video_pruning_rate applies to Qwen2-VL, Qwen2.5-VL and Qwen3-VL videos, not this model's")
        # a dual-tower embedder's requests: one text or one image each (multimodal/dual_tower_items.py)
        self.dual_tower = self.mm_processor if isinstance(self.mm_processor, DualTowerProcessor) else None
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, loaded.max_model_len)
        self.structured_outputs_config = structured_outputs_config
        self.vocab_size = loaded.hf_config.get_text_config().vocab_size  # the text model's, read once
        self._grammar_checker = None  # a StructuredOutputManager that only validates (built on first use)

    # -- prompts -----------------------------------------------------------------------------------------------
    def process_prompt(
        self,
        prompt: Any,
        images: list | None = None,
        videos: list | None = None,
        mm_processor_kwargs: dict | None = None,
        audios: list | None = None,
    ) -> ProcessedPrompt:
        """A string, token ids, or a vLLM-style dict {"prompt"/"prompt_token_ids", "multi_modal_data", "cache_salt"}."""
        mm_data: dict[str, Any] = {}
        text: str | None = None
        token_ids: list[int] | None = None
        cache_salt = None
        if isinstance(prompt, dict):
            known = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs", "cache_salt"}
            unknown = set(prompt) - known
            if unknown:
                raise ValueError(
                    f"unknown prompt keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids' and 'multi_modal_data'"
                )
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            cache_salt = check_cache_salt(prompt.get("cache_salt"))
            mm_data = dict(prompt.get("multi_modal_data") or {})
            mm_processor_kwargs = {**(prompt.get("mm_processor_kwargs") or {}), **(mm_processor_kwargs or {})}
        elif isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if images is not None:
            mm_data["image"] = images
        if videos is not None:
            mm_data["video"] = videos
        if audios is not None:
            mm_data["audio"] = audios
        if isinstance(mm_data.get("audio"), tuple):  # one (array, sample_rate) clip, not a list of clips
            mm_data["audio"] = [mm_data["audio"]]
        mm_data = {k: (v if isinstance(v, list) else [v]) for k, v in mm_data.items() if v is not None}
        mm_data = {k: v for k, v in mm_data.items() if v}
        if self.dual_tower is not None:  # one text or one image (multimodal/dual_tower_items.py)
            if text is not None and not isinstance(text, str):
                raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
            if text is None and token_ids is None:
                raise ValueError("the prompt dict needs 'prompt' or 'prompt_token_ids'")
            check_prompt_chars(text or "", self.max_prompt_chars, self.loaded.max_model_len)
            self._check_media(mm_data)
            if any(isinstance(item, ImageEmbeds) for item in mm_data.get("image", [])):
                raise ValueError("a dual-tower embedder computes its image embeddings itself; send the image")
            kwargs = {**self.default_mm_kwargs, **(mm_processor_kwargs or {})}
            ids, features = self.dual_tower.process_request(text, token_ids, mm_data, kwargs)
            return ProcessedPrompt(text, ids, features, cache_salt)
        if token_ids is None:
            if text is None:
                raise ValueError("the prompt dict needs 'prompt' or 'prompt_token_ids'")
            if not isinstance(text, str):
                raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
            placeholders = getattr(self.mm_processor, "placeholders", None) or _PLACEHOLDERS
            if mm_data and not any(placeholders[m] in text for m in mm_data if m in placeholders):
                text = self._wrap_in_chat_template(text, mm_data)
            token_ids = self._tokenize(text, add_special_tokens=True)
        else:
            vocab = self.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        processed = self._with_media(text, token_ids, mm_data, mm_processor_kwargs)
        return processed if cache_salt is None else replace(processed, cache_salt=cache_salt)

    def process_chat(
        self,
        messages: list[dict],
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        media_source=None,
        options: ChatTemplateOptions | None = None,
    ) -> ProcessedPrompt:
        """OpenAI-format messages through the checkpoint's chat template (media parts are collected in order).
        `media_source(part_type, part)` turns a media part into what the loader takes (the server passes
        pre-fetched bytes); the default accepts data:/file: URLs, paths and in-memory media. `options`: see
        ChatTemplateOptions (default: a generation prompt, no special tokens added)."""
        options = options or ChatTemplateOptions()
        template_messages, mm_data = parse_chat_messages(messages, media_source or default_media_source)
        if self.dual_tower is not None:  # one text or one image part, no template
            text = single_part(template_messages).get("text")
            return self.process_prompt(
                {"prompt": text or "", "multi_modal_data": mm_data}, None, None, mm_processor_kwargs
            )
        text = self._render_chat(template_messages, chat_template_kwargs, options)
        token_ids = self._tokenize(text, add_special_tokens=options.add_special_tokens)
        return self._with_media(text, token_ids, mm_data, mm_processor_kwargs)

    def _render_chat(
        self, messages: list[dict], chat_template_kwargs: dict | None = None, options: ChatTemplateOptions | None = None
    ) -> str:
        """Parsed messages (content parts in the "openai" shape) through the chat template, in the content format
        the template takes; transformers renders it in its sandboxed Jinja environment."""
        kwargs = dict(chat_template_kwargs or {})
        template = kwargs.get("chat_template") or self.tokenizer.chat_template
        if template is None:
            raise ValueError(
                "this model's tokenizer has no chat template; give a plain prompt (with the media "
                "placeholder tokens, if any) instead"
            )
        content_format = resolve_content_format(self.chat_template_content_format, template)
        options = options or ChatTemplateOptions()
        return self.tokenizer.apply_chat_template(
            to_content_format(messages, content_format),
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **kwargs,
        )

    def _wrap_in_chat_template(self, text: str, mm_data: dict[str, list]) -> str:
        parts = [{"type": m} for m in ("image", "video", "audio") for _ in mm_data.get(m, [])]
        return self._render_chat([{"role": "user", "content": parts + [{"type": "text", "text": text}]}])

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_prompt_chars(text, self.max_prompt_chars, self.loaded.max_model_len)  # before the tokenizer's work
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        return ids

    def _with_media(self, text, token_ids, mm_data, mm_processor_kwargs) -> ProcessedPrompt:
        if not mm_data:
            return ProcessedPrompt(text, token_ids, [])
        self._check_media(mm_data)
        for item in mm_data.get("image", []):
            if isinstance(item, ImageEmbeds):
                item.check(self.loaded.hf_config)  # width and grid against this model (ValueError)
        kwargs = {**self.default_mm_kwargs, **(mm_processor_kwargs or {})}
        token_ids, features = self.mm_processor.process(
            token_ids, mm_data.get("image", []), mm_data.get("video", []), kwargs, audios=mm_data.get("audio", [])
        )
        return ProcessedPrompt(text, token_ids, features)

    def _check_media(self, mm_data: dict[str, list]) -> None:
        """ValueError for media this model does not take or over `limit_mm_per_prompt`."""
        for modality, items in mm_data.items():
            if modality not in self.loaded.modalities:
                what = (
                    "a text-only model"
                    if not self.loaded.modalities
                    else f"a model that takes {', '.join(self.loaded.modalities)}"
                )
                raise ValueError(f"{modality} input was given to {what} ({self.loaded.model_path})")
            limit = self.limit_mm_per_prompt.get(modality)
            if limit is not None and len(items) > limit:
                raise ValueError(f"{len(items)} {modality} items exceed limit_mm_per_prompt[{modality!r}]={limit}")

    # -- metrics -----------------------------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """The multimodal processor cache's counters, as named on /metrics (0 for a text-only model): they count in
        the process that runs this InputProcessor, which is where media are processed."""
        proc = self.mm_processor
        return {
            "vlserve:mm_processor_cache_hits_total": getattr(proc, "cache_hits", 0),
            "vlserve:mm_processor_cache_misses_total": getattr(proc, "cache_misses", 0),
        }

    # -- requests ----------------------------------------------------------------------------------------------
    def check_structured_outputs(self, constraint: Any) -> None:
        """ValueError with the compiler's message when a constraint does not compile or accepts no output, before
        the request reaches the engine (compiled grammars are cached, so a second check is cheap)."""
        if self._grammar_checker is None:
            from vlserve.structured_output.manager import StructuredOutputManager  # xgrammar: only when used
            from vlserve.structured_output.params import StructuredOutputsConfig

            self._grammar_checker = StructuredOutputManager(
                self.tokenizer,
                self.loaded.hf_config.get_text_config().vocab_size,
                StructuredOutputsConfig.from_any(self.structured_outputs_config),
                stop_token_ids=self.loaded.eos_token_ids,
            )
        self._grammar_checker.validate(constraint)

    def with_remote_media(self, processed: ProcessedPrompt, kv_params: dict | None) -> ProcessedPrompt:
        """A disaggregated consumer's request whose media the producer encoded: the producer's kv_transfer_params
        carry the expanded prompt and the items without pixel data (the request itself carries no media); they
        replace the prompt this server rendered. A request that brought its media keeps it."""
        if (
            not kv_params
            or not kv_params.get("do_remote_prefill")
            or not kv_params.get("remote_mm_features")
            or processed.mm_features
        ):
            return processed
        ids = kv_params.get("remote_prompt_token_ids")
        vocab = self.vocab_size
        if not isinstance(ids, list) or not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError("kv_transfer_params.remote_prompt_token_ids must be a non-empty list of token ids")
        try:
            features = [feature_from_remote(d) for d in kv_params["remote_mm_features"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad kv_transfer_params.remote_mm_features: {shorten(str(e))}") from None
        for f in features:
            if f.modality not in self.loaded.modalities or f.offset < 0 or f.length <= 0 or f.end > len(ids):
                raise ValueError(
                    f"bad kv_transfer_params.remote_mm_features item ({f.modality} at {f.offset}, "
                    f"{f.length} tokens) for this model and prompt"
                )
        mrope = getattr(self.loaded, "mrope_positions_fn", None)
        if mrope is not None:  # the items' grids must give their spans (what the runner computes positions from)
            try:
                mrope(ids, features)
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"bad kv_transfer_params.remote_mm_features: {shorten(str(e))}") from None
        return replace(processed, prompt_token_ids=list(ids), mm_features=features)

    def truncate_prompt(self, processed: ProcessedPrompt, num_tokens: int | None) -> ProcessedPrompt:
        """The prompt's last `num_tokens` tokens (vLLM's truncate_prompt_tokens; -1: max_model_len; None: all),
        its text decoded from them when it was cut. ValueError when `num_tokens` is over max_model_len or when it
        would cut a prompt with media (only text-only prompts are cut)."""
        if num_tokens is None:
            return processed
        max_model_len = self.loaded.max_model_len
        if num_tokens > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({num_tokens}) is greater than max_model_len ({max_model_len}); "
                f"give a smaller truncation size"
            )
        keep = max_model_len if num_tokens == -1 else num_tokens
        cut = len(processed.prompt_token_ids) - keep
        if cut <= 0:
            return processed
        if processed.mm_features:
            raise ValueError(
                f"truncate_prompt_tokens={num_tokens} would cut a prompt with media input "
                f"({len(processed.prompt_token_ids)} tokens); this server truncates text-only prompts"
            )
        ids = processed.prompt_token_ids[cut:]
        return replace(processed, prompt=self.tokenizer.decode(ids), prompt_token_ids=ids)

    def prepare(self, processed: ProcessedPrompt, params: SamplingParams) -> ProcessedPrompt:
        """The prompt the engine runs: a disaggregated consumer's remote media (`with_remote_media`), then
        truncated to `params.truncate_prompt_tokens`."""
        processed = self.with_remote_media(processed, params.kv_transfer_params)
        return self.truncate_prompt(processed, params.truncate_prompt_tokens)

    def make_engine_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float,
        lora_request: Any = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Bind a processed prompt to sampling params (EOS ids filled in from the checkpoint), the LoRA adapter
        it runs with (None: the base model) and its scheduling priority. An adapter with tower / projector weights
        makes the items' embeddings its own: their mm_hash gains `:lora:<id>`, so the encoder cache never mixes
        them with the base's."""
        params = copy.copy(params)  # (validated when it was made: a copy, not __post_init__ again)
        params._eos_token_ids = self.loaded.eos_token_ids
        params = bind_logits_fields(params, self.tokenizer, self.vocab_size)
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        features = processed.mm_features
        if lora_request is not None and features and adapter_targets_encoder(lora_request.lora_path):
            features = [replace(f, mm_hash=f"{f.mm_hash}:lora:{lora_request.lora_int_id}") for f in features]
        return EngineCoreRequest(
            request_id,
            processed.prompt_token_ids,
            params,
            arrival_time,
            features,
            lora_request,
            priority,
            processed.cache_salt,
        )
