"""A finished generation -> a Response's output items, status and usage; the Response a request starts as."""

from __future__ import annotations

from typing import Any

from vlserve.api.responses.protocol import (
    FunctionCallItem,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from vlserve.api.responses.reasoning import split_reasoning
from vlserve.api.tool_choice import ToolPlan
from vlserve.outputs import RequestOutput


def initial_response(req: ResponsesRequest, model: str) -> ResponseObject:
    """The Response of `req` before any output: the request's settings echoed, status "in_progress"."""
    return ResponseObject(
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=list(req.tools or []),
        tool_choice=req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=req.text if req.text and req.text.get("format") else {"format": {"type": "text"}},
        previous_response_id=req.previous_response_id,
        store=req.store,
        metadata=req.metadata,
        user=req.user,
    )


def output_items(
    text: str, plan: ToolPlan, reasoning_parser: Any | None, status: str = "completed"
) -> list[OutputItem]:
    """The output of a finished text: a reasoning item (when the parser finds reasoning), the message (its text
    with tool calls taken out; left out when only tool calls remain), then one function_call item per call; the
    message and calls carry `status`."""
    reasoning, content = split_reasoning(reasoning_parser, text)
    items: list[OutputItem] = []
    if reasoning is not None:
        items.append(ReasoningItem(content=[ReasoningText(text=reasoning)]))
    parser = plan.new_parser()
    calls = []
    if parser is not None:
        found, calls = parser.extract_tool_calls(content)
        content = found or ""
    if content or not calls:
        items.append(MessageItem(content=[OutputText(text=content)], status=status))
    items += [FunctionCallItem(name=c.function.name, arguments=c.function.arguments, status=status) for c in calls]
    return items


def item_status(response: ResponseObject) -> str:
    """The status of a finished Response's message and call items: "incomplete" when the Response is."""
    return "incomplete" if response.status == "incomplete" else "completed"


def usage_of(final: RequestOutput, reasoning_parser=None) -> ResponseUsage:
    """Token counts of one finished request (reasoning tokens counted by the server's reasoning parser, if any)."""
    prompt = len(final.prompt_token_ids)
    output = sum(len(c.token_ids) for c in final.outputs)
    reasoning = 0
    if reasoning_parser is not None:
        reasoning = sum(
            reasoning_parser.num_reasoning_tokens(c.token_ids, final.prompt_token_ids) for c in final.outputs
        )
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
        output_tokens=output,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
        total_tokens=prompt + output,
    )


def finish(response: ResponseObject, final: RequestOutput, reasoning_parser=None) -> None:
    """Set status ("incomplete" with reason max_output_tokens when the length ran out, else "completed") and
    usage."""
    if final.outputs[0].finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = {"reason": "max_output_tokens"}
    else:
        response.status = "completed"
    response.usage = usage_of(final, reasoning_parser)
