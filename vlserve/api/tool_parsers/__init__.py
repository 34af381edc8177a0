"""Tool-call parsers (--tool-call-parser): read the tool calls a model writes into its text for tool_choice "auto".

`ToolParserManager.get(name)` gives a parser class; register more with `@ToolParserManager.register("name")` on a
`ToolParser` subclass that implements `parse`. Built in: "hermes" (`<tool_call>{...}</tool_call>`, Qwen2.5-VL).
"""

from vlserve.api.tool_parsers.base import ParsedCall, ToolParser, ToolParserManager
from vlserve.api.tool_parsers.hermes import HermesToolParser

__all__ = ["HermesToolParser", "ParsedCall", "ToolParser", "ToolParserManager"]
