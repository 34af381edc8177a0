"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) on the chat endpoint's input side.

protocol: request and Response models; convert: input items -> chat messages, tools, text.format; output: output
items, status, usage; streaming: the SSE event sequence; store: the LRU store for previous_response_id; reasoning:
where reasoning items are read out; serving: the handler and `install_responses_routes`.
"""

from vlserve.api.responses.serving import OpenAIServingResponses, install_responses_routes
from vlserve.api.responses.store import DEFAULT_STORE_SIZE, ResponseStore

__all__ = ["DEFAULT_STORE_SIZE", "OpenAIServingResponses", "ResponseStore", "install_responses_routes"]
