"""A streamed Response as server-sent events, in the order the `openai` client's stream accumulator takes:

response.created, response.in_progress; per output item response.output_item.added, then for a message
response.content_part.added, response.output_text.delta..., response.output_text.done, response.content_part.done,
for a function call response.function_call_arguments.delta..., response.function_call_arguments.done; then
response.output_item.done; last response.completed (response.incomplete when max_output_tokens ran out, or
response.failed after an error). Every event carries `type` and an increasing `sequence_number`.
"""

from __future__ import annotations

import json
from typing import Any

from vlserve.api.responses.protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
)


class EventWriter:
    """Numbers and frames events (`event: <type>` + `data: <json>`)."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self(kind, response=response.model_dump())


class OutputStreamer:
    """The output items of one streamed Response, built from text, tool-call and reasoning pieces; each method
    returns the events it makes. One item is open at a time: a new kind of piece closes it."""

    def __init__(self, write: EventWriter):
        self.write = write
        self.items: list[OutputItem] = []
        self.open: MessageItem | FunctionCallItem | None = None
        self.calls: dict[int, FunctionCallItem] = {}  # the tool parser's call index -> its item

    def _add(self, item: OutputItem) -> str:
        self.items.append(item)
        dumped = item.model_dump()
        if isinstance(item, MessageItem):
            dumped.update(status="in_progress", content=[])
        elif isinstance(item, FunctionCallItem):
            dumped.update(status="in_progress", arguments="")
        return self.write("response.output_item.added", output_index=len(self.items) - 1, item=dumped)

    def close(self, status: str = "completed") -> list[str]:
        """Finish the open item, if any, with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        index = len(self.items) - 1
        events = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            at = dict(item_id=item.id, output_index=index, content_index=0)
            events += [
                self.write("response.output_text.done", **at, text=part.text, logprobs=[]),
                self.write("response.content_part.done", **at, part=part.model_dump()),
            ]
        else:
            events.append(
                self.write(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        events.append(self.write("response.output_item.done", output_index=index, item=item.model_dump()))
        return events

    def text(self, delta: str) -> list[str]:
        """Message text (opens a message item when none is open)."""
        events = []
        if not isinstance(self.open, MessageItem):
            events += self.close()
            self.open = MessageItem(content=[OutputText()])
            events.append(self._add(self.open))
            part = OutputText().model_dump()
            at = dict(item_id=self.open.id, output_index=len(self.items) - 1, content_index=0)
            events.append(self.write("response.content_part.added", **at, part=part))
        if delta:
            self.open.content[0].text += delta
            at = dict(item_id=self.open.id, output_index=len(self.items) - 1, content_index=0)
            events.append(self.write("response.output_text.delta", **at, delta=delta, logprobs=[]))
        return events

    def call(self, index: int, name: str | None, arguments: str) -> list[str]:
        """Tool call `index` of the parser: a name starts it (closing the open item), then argument fragments."""
        events = []
        if name is not None:
            events += self.close()
            self.open = self.calls[index] = FunctionCallItem(name=name)
            events.append(self._add(self.open))
        item = self.calls[index]
        if arguments:
            item.arguments += arguments
            output_index = self.items.index(item)
            events.append(
                self.write(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=output_index,
                    delta=arguments,
                )
            )
        return events

    def reasoning(self, text: str) -> list[str]:
        """A whole reasoning item (added and done at once)."""
        events = self.close()
        item = ReasoningItem(content=[ReasoningText(text=text)])
        self.items.append(item)
        index = len(self.items) - 1
        added = item.model_dump()
        events.append(self.write("response.output_item.added", output_index=index, item=added))
        events.append(self.write("response.output_item.done", output_index=index, item=item.model_dump()))
        return events

    def finish(self, status: str = "completed") -> list[str]:
        """Close the open item with `status`; an output with neither message nor call gets an empty message (as
        non-streamed)."""
        events = self.close(status)
        if not any(isinstance(i, (MessageItem, FunctionCallItem)) for i in self.items):
            events += self.text("") + self.close(status)
        return events
