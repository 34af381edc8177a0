"""The chat stream's first chunk (the assistant role) leaves with the first output, as vLLM sends it: a client
times TTFT from the first chunk, so sending the role on admission would report the queue time as TTFT."""

import asyncio
import json

from vlserve.api.serving_chat import OpenAIServingChat
from vlserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


class _GatedStream:
    """Yields one unfinished then one finished output, each only once its gate is opened."""

    def __init__(self):
        self.gates = [asyncio.Event(), asyncio.Event()]
        self.sent = 0
        self.aborted = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.sent == 2:
            raise StopAsyncIteration
        await self.gates[self.sent].wait()
        self.sent += 1
        done = self.sent == 2
        text = "hi" if not done else "hi there"
        out = CompletionOutput(0, text, [1] * self.sent, finish_reason="length" if done else None)
        return RequestOutput("r", None, [5, 6], [out], done, RequestMetrics(arrival_time=0.0))

    def abort(self):
        self.aborted = True


def test_role_chunk_waits_for_the_first_output():
    async def run():
        stream = _GatedStream()
        gen = OpenAIServingChat._stream(None, stream, "chatcmpl-x", "m", 1, 0, 0, False)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "a chunk left before the engine produced anything"
        stream.gates[0].set()
        role = json.loads((await first).removeprefix("data: "))
        assert role["choices"][0]["delta"]["role"] == "assistant"
        content = json.loads((await gen.__anext__()).removeprefix("data: "))
        assert content["choices"][0]["delta"]["content"] == "hi"
        stream.gates[1].set()
        rest = [c async for c in gen]
        assert json.loads(rest[0].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert rest[-1].strip() == "data: [DONE]"

    asyncio.run(run())
