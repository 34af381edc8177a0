"""POST /v1/chat/completions: messages (text, image_url, video_url, input_audio) -> one completion or an SSE stream;
tools / tool_choice (vlserve.api.tool_choice) -> tool_calls in the message or as streamed deltas; with a reasoning
parser (vlserve.api.reasoning_output) the reasoning is split off first and tool calls are read from the content."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlserve.api.errors import APIError, sse_error, to_api_error
from vlserve.api.media import PASSTHROUGH_PARTS, URL_PARTS, MediaFetcher
from vlserve.api.media_controls import MediaIOControls
from vlserve.api.prompt_logprobs import prompt_logprobs_body
from vlserve.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    random_id,
)
from vlserve.api.reasoning_output import ReasoningOutput, reasoning_parser_of
from vlserve.api.request_extras import (
    TokenIdsDelta,
    chat_echo_text,
    chat_template_options,
    check_beam_search_extras,
    reply_role,
    with_prompt_extras,
)
from vlserve.api.serving_base import (
    SSE_DONE,
    DeltaTracker,
    EngineStreamingResponse,
    MMKwargLimits,
    ServedModels,
    check_fits_context,
    check_kv_transfer_params,
    check_mm_processor_kwargs,
    run_unless_disconnected,
    sse,
    structured_backend,
    usage_of,
    with_pruning_rate,
)
from vlserve.api.serving_beam import beam_chat, wants_beam_search
from vlserve.api.tool_choice import ToolPlan, plan_tools
from vlserve.api.tool_parsers import ToolParserManager
from vlserve.engine.async_llm import AsyncLLM, RequestStream
from vlserve.engine.generation_config import GenerationDefaults
from vlserve.engine.input_processor import ChatTemplateOptions, ProcessedPrompt
from vlserve.outputs import Logprob, RequestOutput
from vlserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def chat_logprobs(entries: list[dict[int, Logprob]] | None, top_k: int) -> ChatLogprobs | None:
    """OpenAI chat logprobs from per-token {token_id: Logprob} dicts (the sampled token is the first key)."""
    if entries is None:
        return None
    content = []
    for entry in entries:
        if not entry:
            continue
        items = list(entry.values())
        sampled = items[0]
        top = sorted((lp for lp in items if lp.rank is not None and lp.rank <= top_k), key=lambda lp: lp.rank)
        token = sampled.decoded_token or ""
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=max(sampled.logprob, -9999.0),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=t.decoded_token or "",
                        logprob=max(t.logprob, -9999.0),
                        bytes=list((t.decoded_token or "").encode("utf-8")),
                    )
                    for t in top
                ],
            )
        )
    return ChatLogprobs(content=content)


async def prepare_input(coro):
    """Await input processing; any failure there is the client's input (400), never a 500. Our own checks raise
    ValueError with a message meant for the client; anything else is logged and reported by its type only, so
    library internals (class paths, file names) do not leak."""
    try:
        return await coro
    except APIError:
        raise
    except ValueError as e:  # includes UnicodeError
        raise APIError(f"could not process the input: {e}", 400) from None
    except Exception as e:  # noqa: BLE001 -- decoding/processing errors of untrusted media
        logger.info("input processing failed", exc_info=e)
        raise APIError(
            f"could not process the input ({type(e).__name__}); check the messages, media and "
            f"mm_processor_kwargs / chat_template_kwargs",
            400,
        ) from None


class OpenAIServingChat:
    """Validates, fetches media, processes, queues, and renders chat completions."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        fetcher: MediaFetcher,
        trust_request_chat_template: bool = False,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        generation_defaults: GenerationDefaults | None = None,
    ):
        self.engine = engine
        self.generation_defaults = generation_defaults or GenerationDefaults()  # --generation-config
        self.models = models
        self.fetcher = fetcher
        parser = None if tool_call_parser is None else ToolParserManager.get(tool_call_parser)
        if enable_auto_tool_choice and parser is None:
            raise ValueError(
                f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(ToolParserManager.names())})"
            )
        self.limits = dict(engine.engine_args.limit_mm_per_prompt or {})
        self.mm_kwarg_limits = MMKwargLimits.from_engine(engine)
        self.media_controls = MediaIOControls.from_engine(engine, fetcher.config)
        self.trust_request_chat_template = trust_request_chat_template
        self.auto_tool_parser = parser if enable_auto_tool_choice else None  # tool_choice "auto" is refused without
        self.structured_backend = structured_backend(engine)
        self.reasoning_parser = reasoning_parser_of(engine)  # --reasoning-parser; None: all text is content

    def _check_media(self, messages: list[dict]) -> None:
        """Fail fast (before any download) on modalities the model lacks and on too many items."""
        counts = Counter((URL_PARTS | PASSTHROUGH_PARTS)[t] for t, _ in self.fetcher.media_parts(messages))
        for modality, count in counts.items():
            if modality not in self.engine.modalities:
                what = ", ".join(self.engine.modalities) or "text only"
                raise APIError(f"{modality} input is not supported by this model (it takes: {what})", 400, "messages")
            limit = self.limits.get(modality)
            if limit is not None and count > limit:
                raise APIError(
                    f"{count} {modality} items exceed the limit of {limit} per prompt (--limit-mm-per-prompt)",
                    400,
                    "messages",
                )

    async def _process(
        self, req: ChatCompletionRequest, tools: list | None = None, options: ChatTemplateOptions | None = None
    ) -> ProcessedPrompt:
        """The request's messages (media fetched) through the chat template (with `options`) and the processor;
        `tools` go to the template."""
        template_kwargs = req.template_kwargs(self.trust_request_chat_template)
        if tools:  # after the kwargs check, which refuses a client's own "tools" key
            template_kwargs["tools"] = tools
        mm_kwargs = check_mm_processor_kwargs(req.mm_processor_kwargs, self.mm_kwarg_limits)
        mm_kwargs = self.media_controls.merge(getattr(req, "media_io_kwargs", None), mm_kwargs)
        mm_kwargs = with_pruning_rate(mm_kwargs, getattr(req, "video_pruning_rate", None))
        messages = req.messages_as_dicts()
        self._check_media(messages)
        self.media_controls.check_parts(messages)
        payloads = await self.fetcher.resolve(messages)
        return await prepare_input(
            self.engine.process_chat(
                messages,
                mm_kwargs,
                template_kwargs,
                media_source=self.media_controls.media_source(payloads),
                options=options,
            )
        )

    async def prepare(
        self, req: ChatCompletionRequest, max_tokens_field: str | None = None
    ) -> tuple[ToolPlan, SamplingParams, ProcessedPrompt]:
        """A chat request's tool plan, sampling params and processed prompt, checked against the context (the
        input side of the chat endpoint, shared with the Responses front end). `max_tokens_field`: the name a
        too-long request's error gives (default: the chat field the client used)."""
        if req.thinking_token_budget is not None and self.reasoning_parser is None:
            raise APIError(
                "thinking_token_budget needs a reasoning parser: start the server with --reasoning-parser",
                400,
                "thinking_token_budget",
            )
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.auto_tool_parser)
        params = req.to_sampling_params(tool_schema=plan.constraint(), structured_backend=self.structured_backend)
        params = self.generation_defaults.apply_to_request(params, req)
        options = chat_template_options(req)
        processed = with_prompt_extras(self.engine, await self._process(req, plan.tools, options), req)
        kv = params.kv_transfer_params or {}
        remote_ids = (
            kv.get("remote_prompt_token_ids") if kv.get("remote_mm_features") and not processed.mm_features else None
        )  # a decode server's media-less request: the producer's expanded prompt is what runs
        num_prompt = len(remote_ids) if isinstance(remote_ids, list) else len(processed.prompt_token_ids)
        check_fits_context(
            params.max_tokens,
            num_prompt,
            self.engine.max_model_len,
            max_tokens_field or ("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"),
        )
        return plan, params, processed

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Handle one request (errors raise APIError / ValueError, which the app renders as OpenAI errors)."""
        model = self.models.check(req.model)
        lora = self.models.lora_of(model)
        check_kv_transfer_params(self.engine, req)
        if wants_beam_search(req):
            check_beam_search_extras(req)
            if lora is not None:
                raise APIError("beam search with a LoRA adapter is not supported yet", 400, "model")
            if req.thinking_token_budget is not None:
                raise APIError("thinking_token_budget is not supported with beam search", 400, "thinking_token_budget")
            return await beam_chat(self.engine, req, raw, model, self._process, self.reasoning_parser)
        plan, params, processed = await self.prepare(req)
        request_id = random_id("chatcmpl")
        stream = await self.engine.add_request(request_id, processed, params, lora, req.priority)
        top_k = req.top_logprobs or 0
        reasoning = ReasoningOutput(self.reasoning_parser, processed.prompt_token_ids, req.include_reasoning)
        if req.stream:
            holdback = max((len(s) for s in params.stop), default=1) - 1
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return EngineStreamingResponse(
                self._stream(
                    stream,
                    request_id,
                    model,
                    params.n,
                    top_k,
                    holdback,
                    req.include_usage,
                    continuous,
                    plan,
                    reasoning,
                    req,
                )
            )
        final = await run_unless_disconnected(raw, last_output(stream), stream.abort)
        choices = []
        echo, token_ids = chat_echo_text(req), req.return_token_ids
        for c in final.outputs:
            message, finish_reason = _message(plan, c.text, c.finish_reason, reasoning)
            message.role = reply_role(req)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=chat_logprobs(c.logprobs, top_k),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if token_ids else None,
                )
            )
        body = ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_of([final], self.reasoning_parser),
            kv_transfer_params=final.kv_transfer_params,
            prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
            prompt_token_ids=final.prompt_token_ids if token_ids else None,
        )
        return JSONResponse(body.model_dump())

    async def _stream(
        self,
        stream: RequestStream,
        request_id: str,
        model: str,
        n: int,
        top_k: int,
        holdback: int,
        include_usage: bool,
        continuous_usage: bool = False,
        plan: ToolPlan | None = None,
        reasoning: ReasoningOutput | None = None,
        req: ChatCompletionRequest | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        plan = plan or ToolPlan()
        role, echo = (reply_role(req), chat_echo_text(req)) if req is not None else ("assistant", "")
        new_token_ids = TokenIdsDelta(req is not None and req.return_token_ids)
        parsers = {i: plan.new_parser() for i in range(n)}  # per choice; None: plain content
        reasoning = reasoning or ReasoningOutput(None, [])
        splits = {i: reasoning.new_stream() for i in range(n)}  # per choice; None: no reasoning parser
        released = {i: "" for i in range(n)}  # each choice's text sent through its parser so far

        def chunk(choices, usage=None, prompt_token_ids=None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=choices,
                    usage=usage,
                    prompt_token_ids=prompt_token_ids,
                )
            )

        tracker = DeltaTracker(holdback)
        last: RequestOutput | None = None
        try:
            async for out in stream:
                if last is None:  # the role goes out with the first output, as vLLM sends it (TTFT counts from it)
                    yield chunk(
                        [ChatStreamChoice(index=i, delta=DeltaMessage(role=role, content="")) for i in range(n)],
                        prompt_token_ids=out.prompt_token_ids if new_token_ids.enabled else None,
                    )
                    if echo:  # then the echoed last message, as vLLM sends it
                        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=echo)) for i in range(n)])
                last = out
                choices = []
                for c in out.outputs:
                    if c.index in tracker.done:
                        continue
                    finished = c.finish_reason is not None
                    text, lps = tracker.delta(c.index, c.text, c.logprobs, finished)
                    thought, split = None, splits.get(c.index)
                    if split is not None:
                        thought, text = split.feed(text, finished)
                        text = text or ""
                    delta, finish_reason, parser = DeltaMessage(content=text), c.finish_reason, parsers.get(c.index)
                    news = bool(text)
                    if parser is not None:
                        released[c.index] += text
                        parsed = parser.extract_tool_calls_streaming(released[c.index], finished)
                        delta, news = parsed or DeltaMessage(content=""), parsed is not None
                        finish_reason = plan.finish_reason(finish_reason, parser.streamed_calls > 0)
                    if thought and reasoning.include:
                        reasoning.attach(delta, thought)
                        delta.content, news = delta.content or None, True
                    if news or finished or lps:
                        choices.append(
                            ChatStreamChoice(
                                index=c.index,
                                delta=delta,
                                logprobs=chat_logprobs(lps, top_k),
                                finish_reason=finish_reason,
                                stop_reason=c.stop_reason,
                                token_ids=new_token_ids.delta(c.index, c.token_ids),
                            )
                        )
                if choices:
                    yield chunk(choices, usage_of([out], reasoning.parser) if continuous_usage else None)
            if include_usage and last is not None:
                yield chunk([], usage_of([last], reasoning.parser))
        except Exception as e:  # noqa: BLE001 -- headers are out: report in-band
            err = to_api_error(e)
            yield sse_error(err.message, err.status)
        finally:
            stream.abort()
        yield SSE_DONE


def _message(
    plan: ToolPlan, text: str, finish_reason: str | None, reasoning: ReasoningOutput | None = None
) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message (the reasoning split off first, then tool calls read out of the content when
    the plan asks) and its finish_reason."""
    reasoning = reasoning or ReasoningOutput(None, [])
    parser = plan.new_parser()
    if parser is None:
        return reasoning.message(text), finish_reason
    thought, content = reasoning.split(text)
    content, calls = (None, []) if content is None else parser.extract_tool_calls(content)
    message = ChatResponseMessage(content=content, tool_calls=calls or None)
    reasoning.attach(message, thought)
    return message, plan.finish_reason(finish_reason, bool(calls))


async def last_output(stream: RequestStream) -> RequestOutput:
    """Drain a request's stream and return its final output."""
    last = None
    async with stream:
        async for out in stream:
            last = out
    if last is None:
        raise APIError("the request ended without output", 500)
    return last
