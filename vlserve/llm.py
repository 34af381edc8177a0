"""`LLM`: the offline, synchronous Python API (vLLM's shape)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from vlserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from vlserve.config import EngineArgs, resolve_model_path
from vlserve.engine.core_messages import KV_POLL_S
from vlserve.engine.engine_loop import EngineLoop, NewRequest
from vlserve.engine.generation_config import load_generation_defaults
from vlserve.engine.input_processor import ChatTemplateOptions, ProcessedPrompt
from vlserve.engine.request_limits import check_chat_template_kwargs
from vlserve.engine.video_session import EngineLoopSessions, VideoSession, VideoSessions
from vlserve.llm_pooling import PoolingCalls
from vlserve.lora.request import LoRARequest
from vlserve.outputs import RequestOutput
from vlserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM(PoolingCalls):
    """Load a local checkpoint and generate for batches of prompts with continuous batching.

    `LLM(model=path, dtype="float32", max_model_len=..., max_num_seqs=..., ...)`; with no model, the embedded demo.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine_args = EngineArgs(model=model, **kwargs)
        if self.engine_args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size > 1 (got {self.engine_args.data_parallel_size}) needs engine "
                "processes, which only `vlserve serve` starts; LLM runs one engine in this process "
                "(start several LLMs, or serve with --data-parallel-size)"
            )
        self.engine_loop = EngineLoop(self.engine_args)  # checks the settings before it reads the checkpoint
        self.engine = self.engine_loop.core
        try:
            self.generation_defaults = load_generation_defaults(
                self.engine_args.generation_config, resolve_model_path(self.engine_args.model)
            )
        except Exception:
            self.engine.shutdown()
            raise
        self.tokenizer = self.engine_loop.tokenizer
        self.input_processor = self.engine_loop.input_processor
        self.output_processor = self.engine_loop.output_processor
        self._ids = itertools.count()
        # A P2P producer's finished requests keep their blocks until the consumer confirms its read (or the send
        # times out); with no generate call running, a daemon thread steps the idle engine until they are freed.
        # `_lock` serializes it with every call that drives the engine.
        self._lock = threading.RLock()
        self._kv_poller: threading.Thread | None = None
        self._closed = False
        self.video_sessions = VideoSessions(self.engine_args.max_video_sessions, self.engine_args.session_idle_timeout)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given no SamplingParams: the built-in defaults, or the ones the
        generation config (`generation_config=`: "auto", "vlserve" or a directory) gives."""
        return self.generation_defaults.sampling_params()

    # -- generation --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        images: list | None = None,
        videos: list | None = None,
        mm_processor_kwargs: dict | None = None,
        audios: list | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists, or {"prompt", "multi_modal_data",
        "cache_salt"} dicts).

        `images`/`videos`/`audios`, when given, hold one entry per prompt (an item or a list of items); an audio
        item is `(np.ndarray, sample_rate)`, encoded bytes, a path or a data URL. `lora_request`: the LoRA adapter
        every prompt runs with, or one per prompt (None: the base model); needs `enable_lora=True`. `priority`:
        one per prompt, under scheduling_policy="priority" (lower first).
        """
        processed = self._process_prompts(prompts, images, videos, audios, mm_processor_kwargs)
        return self._run(processed, sampling_params, use_tqdm, lora_request, priority)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """OpenAI-format conversations (one, or a list of them) through the checkpoint's chat template; `tools`
        (OpenAI function tools) go to the template as vLLM's `LLM.chat(tools=...)` passes them; `lora_request` as
        in `generate`; `add_generation_prompt` / `continue_final_message` as vLLM's (not both)."""
        options = ChatTemplateOptions(add_generation_prompt, continue_final_message)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        # The caller's own code: a chat_template in the kwargs is trusted here (the server refuses it by default).
        chat_template_kwargs = check_chat_template_kwargs(chat_template_kwargs, allow_template=True)
        if tools is not None:
            if not isinstance(tools, list) or any(not isinstance(t, dict) for t in tools):
                raise ValueError("tools must be a list of OpenAI tool objects (dicts)")
            chat_template_kwargs["tools"] = tools
        processed = [
            self.input_processor.process_chat(c, mm_processor_kwargs, chat_template_kwargs, options=options)
            for c in conversations
        ]
        return self._run(processed, sampling_params, use_tqdm, lora_request)

    def _process_prompts(
        self,
        prompts: Any,
        images: list | None,
        videos: list | None,
        audios: list | None,
        mm_processor_kwargs: dict | None,
        conversations: bool = False,
    ) -> list[ProcessedPrompt]:
        """One prompt or a list of them, processed; `images`/`videos`/`audios` hold one entry per prompt. With
        `conversations`, a list of message dicts is a conversation, through the chat template."""
        if _one_prompt(prompts, conversations):
            prompts = [prompts]
        prompts = list(prompts)
        for name, media in (("images", images), ("videos", videos), ("audios", audios)):
            if media is not None and len(media) != len(prompts):
                raise ValueError(f"{name} must have one entry per prompt ({len(prompts)}), got {len(media)}")
        return [
            self.input_processor.process_chat(p, mm_processor_kwargs)
            if conversations and _is_conversation(p)
            else self.input_processor.process_prompt(
                p,
                images=None if images is None else images[i],
                videos=None if videos is None else videos[i],
                mm_processor_kwargs=mm_processor_kwargs,
                audios=None if audios is None else audios[i],
            )
            for i, p in enumerate(prompts)
        ]

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        use_tqdm: bool = False,
        images: list | None = None,
        videos: list | None = None,
        audios: list | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt (a string, token ids, a {"prompt", "multi_modal_data"} dict, or an
        OpenAI-format conversation: a list of message dicts), the `params.beam_width` best beams, best first, each
        with its tokens (prompt + generated), text and cumulative logprob (vlserve.beam_search)."""
        processed = self._process_prompts(prompts, images, videos, audios, mm_processor_kwargs, conversations=True)
        max_len = self.engine.max_model_len
        for proc in processed:
            if len(proc.prompt_token_ids) + params.max_tokens > max_len:
                raise ValueError(
                    f"a prompt of {len(proc.prompt_token_ids)} tokens + max_tokens={params.max_tokens} "
                    f"exceeds max_model_len={max_len}"
                )
        eos = tuple(self.engine.loaded.eos_token_ids)
        searches = [BeamSearch(proc.prompt_token_ids, params, eos) for proc in processed]
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True)
        with self._lock:
            try:
                while not all(s.done for s in searches):
                    live = [(s, proc) for s, proc in zip(searches, processed) if not s.done]
                    now = time.time()
                    requests = [
                        NewRequest(
                            str(next(self._ids)),
                            ProcessedPrompt(None, beam.tokens, proc.mm_features),
                            s.step_params(),
                            now,
                        )
                        for s, proc in live
                        for beam in s.live
                    ]
                    self.engine_loop.add_requests(requests)
                    outs = iter(self._drain([r.request_id for r in requests], use_tqdm=False))
                    for s, _ in live:
                        s.advance(
                            [{t: lp.logprob for t, lp in next(outs).outputs[0].logprobs[0].items()} for _ in s.live]
                        )
                    bar.update(1)
            finally:
                bar.close()
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _run(
        self, processed: list[ProcessedPrompt], sampling_params, use_tqdm: bool, lora_request=None, priority=None
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(processed)
        )
        if len(params_list) != len(processed):
            raise ValueError(f"got {len(params_list)} sampling params for {len(processed)} prompts")
        loras = self._lora_requests(lora_request, len(processed))
        priorities = [0] * len(processed) if priority is None else list(priority)
        if len(priorities) != len(processed):
            raise ValueError(f"got {len(priorities)} priorities for {len(processed)} prompts")
        for lora in dict.fromkeys(r for r in loras if r is not None):  # offline: load now, so a bad one raises here
            self.engine_loop.core.add_lora(lora)
        now = time.time()
        requests = [
            NewRequest(str(next(self._ids)), proc, params, now, lora, prio)
            for proc, params, lora, prio in zip(processed, params_list, loras, priorities)
        ]
        with self._lock:
            self.engine_loop.add_requests(requests)  # all or none: one bad prompt leaves the engine untouched
            return self._drain([r.request_id for r in requests], use_tqdm)

    def _lora_requests(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; ValueError when adapters are asked of an engine without LoRA."""
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
        for lora in loras:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora).__name__}")
        if any(loras) and not self.engine_args.enable_lora:
            raise ValueError("a LoRA request was given but this LLM runs without LoRA: LLM(..., enable_lora=True)")
        return loras

    def _drain(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine_loop.has_unfinished_requests():
                for out in self.engine_loop.step(final_only=True):  # only finished outputs are kept
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine_loop.abort_all()
            raise
        finally:
            bar.close()
            self._start_kv_poller()
        return [finished[rid] for rid in request_ids]

    def _start_kv_poller(self) -> None:
        """Called under `_lock`: start the idle poller when blocks are kept for a transfer and none runs."""
        if self._closed or self._kv_poller is not None or not self.engine_loop.has_kept_kv_blocks():
            return
        self._kv_poller = threading.Thread(
            target=_poll_kept_blocks, args=(weakref.ref(self),), daemon=True, name="vlserve-kv-poll"
        )
        self._kv_poller.start()

    # -- live video ------------------------------------------------------------------------------------------
    def open_video_session(
        self,
        messages: list[dict] | None = None,
        fps: float = 2.0,
        max_frames: int | None = None,
        max_seconds: float | None = None,
        window_slack: int = 0,
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> VideoSession:
        """A live video stream (vlserve.engine.video_session): `session.append(frames)` as frames arrive (at `fps`),
        `session.ask(question, sampling_params)` -> RequestOutput, `session.close()` (or `with`). `messages`: text
        turns before the one holding the video and the question; `max_frames` / `max_seconds` bound the window of
        frames a question sees (the oldest go first; with `window_slack` N, an overflowing window drops N frames
        more, so that the stream's KV is recomputed once every N frames instead of at every append). A question
        reuses the stream's KV through the prefix cache (with enable_prefix_caching=False every question computes
        the whole prompt); `ask` without sampling params uses `get_default_sampling_params()`."""
        return self.video_sessions.create(
            EngineLoopSessions(self.engine_loop, self._lock),
            self.input_processor,
            self.engine.max_model_len,
            messages=messages,
            fps=fps,
            max_frames=max_frames,
            max_seconds=max_seconds,
            window_slack=window_slack,
            mm_processor_kwargs=mm_processor_kwargs,
            chat_template_kwargs=check_chat_template_kwargs(chat_template_kwargs, allow_template=True),
            default_sampling_params=self.get_default_sampling_params,
        )

    # -- introspection -----------------------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """Engine counters and gauges named as on /metrics (e.g. `vlserve:prefix_cache_hits_total`), with the input
        processor's (`vlserve:mm_processor_cache_hits_total`, ...)."""
        return {**self.engine.get_metrics(), **self.input_processor.get_metrics()}

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallel) or actors (Ray) now rather than at exit."""
        with self._lock:
            self._closed = True
            self.engine.shutdown()

    def check_integrity(self) -> None:
        """Assert the KV pool / encoder cache invariants (tests call this after runs)."""
        with self._lock:
            self.engine.check_integrity()


def _is_conversation(prompt: Any) -> bool:
    """An OpenAI-format conversation: a list of message dicts."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _one_prompt(prompts: Any, conversations: bool) -> bool:
    """Whether `prompts` is one prompt (a string, a dict, token ids, with `conversations` a conversation) rather
    than a list of them."""
    return (
        isinstance(prompts, (str, dict))
        or (conversations and _is_conversation(prompts))
        or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
    )


def _poll_kept_blocks(ref) -> None:
    """The idle LLM's poller: step its engine every KV_POLL_S while it keeps blocks for a KV transfer (a P2P
    producer's, freed on the consumer's confirmation or the send timeout); ends when none are left."""
    while True:
        llm = ref()
        if llm is None:
            return
        with llm._lock:
            if llm._closed or not llm.engine_loop.has_kept_kv_blocks():
                llm._kv_poller = None
                return
            try:
                llm.engine_loop.step()
            except Exception:
                logger.exception("idle KV-transfer poll failed; kept blocks wait for the next generate call")
                llm._kv_poller = None
                return
        del llm
        time.sleep(KV_POLL_S)
