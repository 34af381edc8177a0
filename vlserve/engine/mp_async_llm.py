"""`MPAsyncLLM`: the `AsyncLLM` front end with the engine core in its own process (what `vlserve serve` runs).

The API process keeps HTTP, media fetching, input processing (tokenizer, chat template, HF processor: the processed
request — token ids, processed media tensors and their hashes — is what crosses; a live video session's items
cross once per engine, `session_media`) and detokenization (the `OutputProcessor`: stop strings, logprob texts,
n > 1 fan-in), so the engine process spends its GIL only on scheduling and the model. The engine process (`core_proc`) owns the scheduler, KV cache, encoder cache and runner.
Stop-string hits go back to the engine as `FinishStopped`, aborts as `AbortRequests`.

One thread (the base class's "engine thread", here a dispatcher) applies, in order, everything in the inbox: user
adds and aborts, and the engine's messages, which the client's receiver thread posts there too.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import Any

from vlserve.config import EngineArgs, resolve_model_path
from vlserve.engine.async_llm import _STOP, AsyncLLM, EngineDeadError, _Abort, _Add, _post, _settle
from vlserve.engine.core_client import DEFAULT_STARTUP_TIMEOUT, EngineCoreClient, EngineGone
from vlserve.engine.core_messages import (
    AbortRequests,
    AddAck,
    AddRequests,
    ControlAck,
    ControlCall,
    EngineReady,
    FinishStopped,
    StepOutputs,
)
from vlserve.engine.dp_router import DPRouter
from vlserve.engine.engine_control import Control, settle_control
from vlserve.engine.engine_loop import NewRequest
from vlserve.engine.input_processor import InputProcessor
from vlserve.engine.model_setup import LoadedModel
from vlserve.engine.output_processor import OutputProcessor, child_params, child_request_ids
from vlserve.engine.pooling import PoolingRequests, resolve_pooler_spec
from vlserve.engine.session_media import SessionMediaSender, session_of
from vlserve.models.capabilities import model_capabilities
from vlserve.models.registry import get_model_class
from vlserve.outputs import RequestOutput
from vlserve.pooling_params import PoolerSpec
from vlserve.shorten import shorten

logger = logging.getLogger(__name__)


def load_frontend(model_path: str, args: EngineArgs):
    """What input processing needs, without the weights: (hf_config, tokenizer, mm_processor or None)."""
    from transformers import AutoConfig

    from vlserve.engine.mm_setup import dual_tower_processor, video_limits_from_args
    from vlserve.engine.model_setup import load_tokenizer
    from vlserve.multimodal.processor import MultiModalProcessor, wants_fast_processor

    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read config.json in {model_path!r}: {e}") from e
    modalities = model_capabilities(get_model_class(hf_config), hf_config).modalities
    tokenizer = load_tokenizer(model_path, args.tokenizer)
    mm_processor = dual_tower_processor(model_path, hf_config, wants_fast_processor(args.mm_processor_kwargs))
    if modalities and mm_processor is None:
        kwargs = {"max_audio_seconds": args.max_audio_seconds} if "audio" in modalities else {}
        kwargs.update(video_limits_from_args(args) if "video" in modalities else {})
        mm_processor = MultiModalProcessor.from_pretrained(
            model_path, use_fast=wants_fast_processor(args.mm_processor_kwargs), **kwargs
        )
    return hf_config, tokenizer, mm_processor


_MEAN_GAUGES = ("vlserve:kv_cache_usage", "vlserve:encoder_cache_usage")  # fractions: averaged over replicas


def combine_replica_metrics(per_replica: list[dict[str, float]]) -> dict[str, float]:
    """One counter set for N replicas: counts and counters summed, usage fractions averaged."""
    total: dict[str, float] = {}
    for metrics in per_replica:
        for name, value in metrics.items():
            total[name] = total.get(name, 0) + value
    for name in _MEAN_GAUGES:
        if name in total:
            total[name] /= len(per_replica)
    return total


class RemoteCore:
    """Stands in for `EngineCore` on the API side: the checkpoint facts and each engine's latest counters."""

    def __init__(self, loaded: LoadedModel, metrics: list[dict[str, float]], pooler_spec: PoolerSpec | None = None):
        self.loaded = loaded
        self.max_model_len = loaded.max_model_len
        self.replica_metrics = [dict(m) for m in metrics]  # by engine index
        self.pooler_spec = pooler_spec  # the engines' pooler (resolved here too, from the same files), or None
        self.model_capabilities = model_capabilities(get_model_class(loaded.hf_config), loaded.hf_config)

    @property
    def runner_type(self) -> str:
        """ "pooling" when the engines pool prompts, else "generate"."""
        return "generate" if self.pooler_spec is None else "pooling"

    @property
    def pooling_tasks(self) -> set[str]:
        """The PoolingParams tasks the engines serve."""
        return set() if self.pooler_spec is None else self.pooler_spec.supported_tasks

    def shutdown(self) -> None:
        """Nothing here: the engine processes stop when the client closes."""

    def get_metrics(self) -> dict[str, float]:
        """The counters of each engine's last message, summed over the replicas (usage fractions averaged)."""
        return combine_replica_metrics(self.replica_metrics)

    def get_replica_metrics(self) -> list[dict[str, float]]:
        """Each engine's own counters, by engine index."""
        return [dict(m) for m in self.replica_metrics]


class RemoteEngineLoop:
    """`EngineLoop`'s role on the API side: fan-out, output processing and aborts, the cores across sockets.

    With several engines (data-parallel replicas) a `DPRouter` picks each new request's engine and remembers it,
    so its aborts go there; an engine's stop-string hits go back to the engine whose outputs they were."""

    def __init__(self, args: EngineArgs, client: EngineCoreClient, loaded: LoadedModel, ready: list[EngineReady]):
        self.client = client
        spec = resolve_pooler_spec(args, loaded.hf_config, loaded.tokenizer, loaded.model_path)
        self.core = RemoteCore(loaded, [r.metrics for r in ready], spec)
        self.pooling = PoolingRequests(spec, loaded.hf_config.get_text_config().hidden_size)
        self.tokenizer = loaded.tokenizer
        self.input_processor = InputProcessor(
            loaded,
            args.limit_mm_per_prompt,
            args.processor_kwargs(),
            args.chat_template_content_format,
            args.structured_outputs_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.router = DPRouter(len(ready), margin=args.max_num_seqs, block_size=args.block_size)
        self.session_media = SessionMediaSender(len(ready))  # video session items each engine holds already
        self.staged: list[StepOutputs] = []

    def add_requests(self, requests: list[NewRequest]) -> None:
        """Track each request and send it to its engine (its AddAck says whether the core took it)."""
        for r in requests:
            if r.request_id in self.output_processor.parents or r.request_id in self.pooling.open:
                raise ValueError(f"request id {shorten(r.request_id)} is already in use")
        # a disaggregated consumer's remote media, then truncate_prompt_tokens (InputProcessor.prepare)
        requests = [replace(r, processed=self.input_processor.prepare(r.processed, r.params)) for r in requests]
        for r in requests:
            engine_reqs = [
                self.input_processor.make_engine_request(
                    cid, r.processed, child_params(r.params, i), r.arrival, r.lora_request, r.priority
                )
                for i, cid in enumerate(child_request_ids(r.request_id, r.params.n))
            ]
            self.output_processor.add_request(
                r.request_id, r.processed.prompt, r.processed.prompt_token_ids, r.params, r.arrival
            )
            hashes, session = [f.mm_hash for f in r.processed.mm_features], session_of(r.processed.mm_features)
            engine = self.router.route(r.request_id, r.processed.prompt_token_ids, hashes, r.params.n, session)
            if session is not None:  # items this engine holds cross as references (session_media.py)
                engine_reqs = self.session_media.send_requests(r.request_id, engine, engine_reqs)
            self.client.send(AddRequests(r.request_id, engine_reqs), engine)

    def add_pooling_requests(self, requests: list[NewRequest]) -> None:
        """Track pooling requests (PoolingParams; ValueError on bad ones) and send each to its engine."""
        engine_reqs = self.pooling.engine_requests(
            requests, self.input_processor, lambda rid: rid in self.output_processor.parents
        )
        for r, req in zip(requests, engine_reqs):
            self.pooling.track(r)
            engine = self.router.route(
                r.request_id, r.processed.prompt_token_ids, [f.mm_hash for f in r.processed.mm_features], 1
            )
            self.client.send(AddRequests(r.request_id, [req]), engine)

    def forget(self, request_id: str) -> None:
        """Drop a request the engine refused."""
        self.pooling.open.pop(request_id, None)
        self.output_processor.abort(request_id)
        self.router.release(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a user request here and in its engine; its final output, or None when it is not open."""
        if self.pooling.open.pop(request_id, None) is not None:
            engine = self.router.release(request_id)
            if engine is not None:
                self.client.send(AbortRequests([request_id]), engine)
            return None
        child_ids = self.output_processor.child_ids(request_id)
        final = self.output_processor.finish_aborted(request_id)
        engine = self.router.release(request_id)
        if final is not None and engine is not None:
            self.client.send(AbortRequests(child_ids), engine)
        return final

    def abort_all(self) -> list[str]:
        """After a failure: forget every open request, here and in the engines."""
        dropped = list(self.output_processor.parents)
        by_engine: dict[int, list[str]] = {}
        for rid in list(self.pooling.open):
            self.pooling.open.pop(rid)
            engine = self.router.release(rid)
            if engine is not None:
                by_engine.setdefault(engine, []).append(rid)
        for rid in dropped:
            engine = self.router.release(rid)
            children = self.output_processor.abort(rid)
            if engine is not None:
                by_engine.setdefault(engine, []).extend(children)
        for engine, child_ids in by_engine.items():
            if child_ids:
                self.client.send(AbortRequests(child_ids), engine)
        return dropped

    def update_metrics(self, engine_index: int, metrics: dict[str, float]) -> None:
        """An engine's counters, as its latest message carried them."""
        if metrics:
            self.core.replica_metrics[engine_index] = dict(metrics)

    def step(self) -> list[RequestOutput]:
        """Apply the engine step messages received so far; RuntimeError when an engine's step failed."""
        staged, self.staged = self.staged, []
        results: list[RequestOutput] = []
        for msg in staged:
            self.update_metrics(msg.engine_index, msg.metrics)
            core_outputs, pooled = self.pooling.split(msg.outputs)
            outputs, stop_hits = self.output_processor.process_outputs(core_outputs)
            outputs += pooled
            if stop_hits:
                self.client.send(FinishStopped(stop_hits), msg.engine_index)
            for out in outputs:
                if out.finished:
                    self.router.release(out.request_id)
            results.extend(outputs)
            if msg.step_error is not None:
                raise RuntimeError(f"the engine step failed: {msg.step_error}")
        return results

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or bool(self.pooling.open)


class MPAsyncLLM(AsyncLLM):
    """`AsyncLLM` whose engine core runs in a spawned process; same `generate` / `add_request` / `abort` API.

    Start-up spawns the engine, loads the tokenizer and processor here meanwhile, and waits for the engine's
    ready message (`EngineStartupError` with the engine's error text if it fails to load). When the engine process
    dies, every open request fails with `EngineDeadError` and `is_running` turns False.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        input_workers: int | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ):
        model_path = resolve_model_path(engine_args.model)  # a bad path fails here, before any spawn
        client = EngineCoreClient(engine_args, startup_timeout=startup_timeout)  # data_parallel_size engines
        client.spawn()
        try:
            hf_config, tokenizer, mm_processor = load_frontend(model_path, engine_args)
        except BaseException:
            client.close(kill=True)
            raise
        ready = client.wait_ready()
        from vlserve.engine.model_setup import pick_device
        from vlserve.models.loader import resolve_dtype

        loaded = LoadedModel(
            model_path,
            hf_config,
            None,
            tokenizer,
            getattr(mm_processor, "hf_processor", None),
            pick_device("cpu"),
            resolve_dtype(engine_args.dtype, hf_config),
            ready[0].max_model_len,
            ready[0].eos_token_ids,
            modalities=ready[0].modalities,
            mm_processor=mm_processor,
        )
        self.client = client
        self._pending: dict[str, _Add] = {}  # adds sent, AddAck not yet back
        self._controls: dict[int, list] = {}  # control calls sent: call_id -> [Control, engines left, first error]
        self._control_ids = itertools.count()
        super().__init__(engine_args, input_workers, engine_loop=RemoteEngineLoop(engine_args, client, loaded, ready))
        client.start_receiver(self._inbox.put)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> MPAsyncLLM:
        """Spawn the engine process and wait until it has loaded the model."""
        return cls(args, **kwargs)

    @property
    def engine_pid(self) -> int | None:
        """The first engine process's pid."""
        return self.client.pids[0] if self.client.pids else None

    @property
    def engine_pids(self) -> list[int]:
        """Every engine process's pid, by engine index."""
        return self.client.pids

    @property
    def is_running(self) -> bool:
        return super().is_running and self.client.is_alive()

    def get_metrics(self) -> dict[str, float]:
        """The engines' counters as of their last step messages (updated before that step's outputs go out),
        summed over the replicas, and this process's input processor counters (the multimodal processor cache
        lives here, where the media are processed)."""
        return {**self.engine.get_metrics(), **self.input_processor.get_metrics()}

    def get_replica_metrics(self) -> list[dict[str, float]]:
        """Each engine's counters, by engine index (what /metrics labels `engine="i"`)."""
        return self.engine.get_replica_metrics()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the dispatcher (open requests end "abort"), then the engine process."""
        super().shutdown(timeout)
        self.client.close()

    # -- the dispatcher thread -------------------------------------------------------------------------------
    def _run_engine_thread(self) -> None:
        try:
            while True:
                msg = self._inbox.get()
                if msg is _STOP:
                    break
                if isinstance(msg, _Abort):
                    self._do_abort(msg.request_id)
                elif isinstance(msg, _Add):
                    self._do_add(msg)
                elif isinstance(msg, Control):
                    self._do_control(msg)
                else:
                    self._on_engine_message(msg)
                self._metrics = self.engine.get_metrics()
        except BaseException as e:  # the engine process died (or a bug here): fail every open request
            if not isinstance(e, EngineDeadError):
                logger.exception("engine dispatcher died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine stopped: {e}"))
            return
        self._close_open_streams()

    def _do_add(self, msg: _Add) -> None:
        if self._start_stream(msg):  # settled when the engine's AddAck arrives
            self._pending[msg.request_id] = msg

    def _on_engine_message(self, msg: object) -> None:
        if isinstance(msg, StepOutputs) and msg.fatal:  # a rank died and the engine process exits next: dead now
            raise EngineDeadError(f"the engine stopped: {msg.step_error}")  # (/health 503 before requests fail)
        if isinstance(msg, StepOutputs):
            self.engine_loop.staged.append(msg)
            try:
                self._step()
            except Exception as e:
                logger.error("%s; failing the requests in flight", e)
                self._recover(e)
        elif isinstance(msg, AddAck):
            self._on_ack(msg)
        elif isinstance(msg, ControlAck):
            self._on_control_ack(msg)
        elif isinstance(msg, EngineGone):
            code = "" if msg.exitcode is None else f" (exit code {msg.exitcode})"
            which = f" {msg.engine_index}" if self.client.num_engines > 1 else ""
            raise EngineDeadError(f"the engine process{which} exited unexpectedly{code}")
        else:
            logger.warning("unexpected engine message %s ignored", type(msg).__name__)

    def _on_ack(self, ack: AddAck) -> None:
        self.engine_loop.update_metrics(ack.engine_index, ack.metrics)
        add = self._pending.pop(ack.user_request_id, None)
        open_now = add is not None and self._streams.get(ack.user_request_id) is add.stream
        resend = self.engine_loop.session_media.acked(ack.user_request_id, ack.error, open_now)
        if resend is not None:  # the engine lacked a session item: once more, media whole
            self._pending[ack.user_request_id] = add
            self.client.send(AddRequests(ack.user_request_id, resend), ack.engine_index)
            return
        if add is None:
            return
        if ack.error is not None:
            if self._streams.get(ack.user_request_id) is add.stream:
                del self._streams[ack.user_request_id]
                self.engine_loop.forget(ack.user_request_id)
            _post(add.stream.loop, _settle, add.done, ack.error)
        elif not _post(add.stream.loop, _settle, add.done, None):
            self._do_abort(ack.user_request_id)

    def _do_control(self, msg: Control) -> None:
        """Send the call to every engine (data-parallel replicas each hold the adapters); settled by their acks."""
        if msg.op == "evict_encoder_items":  # the engines drop them from their session media stores too
            self.engine_loop.session_media.forget(msg.arg)
        call_id = next(self._control_ids)
        self._controls[call_id] = [msg, self.client.num_engines, None]
        for engine in range(self.client.num_engines):
            self.client.send(ControlCall(call_id, msg.op, msg.arg), engine)

    def _on_control_ack(self, ack: ControlAck) -> None:
        self.engine_loop.update_metrics(ack.engine_index, ack.metrics)
        entry = self._controls.get(ack.call_id)
        if entry is None:
            return
        entry[1] -= 1
        entry[2] = entry[2] or ack.error
        if entry[1] == 0:
            del self._controls[ack.call_id]
            settle_control(entry[0], entry[2], ack.result)

    def _fail_all(self, err: BaseException, drain_inbox: bool = True) -> None:
        pending, self._pending = list(self._pending.values()), {}
        for entry in self._controls.values():
            settle_control(entry[0], err)
        self._controls = {}
        for add in pending:
            _post(add.stream.loop, _settle, add.done, err)
        super()._fail_all(err, drain_inbox)
