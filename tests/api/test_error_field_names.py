"""Errors name the field the client sent: `max_completion_tokens: 0` is refused naming max_completion_tokens (not
the max_tokens it maps to), with that field as the error's `param`; `max_tokens: 0` still names max_tokens.
(No server: the request model and the app's validation-error rendering.)"""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from vlserve.api.errors import _describe_validation
from vlserve.api.protocol import ChatCompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def rendered(body: dict) -> tuple[str, str | None]:
    """(message, param) of the 400 the server answers for `body` when it fails validation."""
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    return _describe_validation(RequestValidationError(errors))


@pytest.mark.parametrize("value", [0, -3])
def test_max_completion_tokens_below_one_names_that_field(value):
    message, param = rendered({"messages": MSG, "max_completion_tokens": value})
    assert param == "max_completion_tokens"
    assert f"max_completion_tokens must be an integer >= 1, got {value}" in message
    assert "max_tokens" not in message


def test_max_completion_tokens_wins_over_max_tokens_and_valid_values_pass():
    req = ChatCompletionRequest.model_validate({"messages": MSG, "max_completion_tokens": 5, "max_tokens": 9})
    assert req.to_sampling_params().max_tokens == 5
    assert ChatCompletionRequest.model_validate({"messages": MSG}).to_sampling_params().max_tokens is None


def test_max_tokens_zero_still_names_max_tokens():
    req = ChatCompletionRequest.model_validate({"messages": MSG, "max_tokens": 0})
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        req.to_sampling_params()


def test_min_tokens_over_max_completion_tokens_names_that_field():
    req = ChatCompletionRequest.model_validate({"messages": MSG, "max_completion_tokens": 3, "min_tokens": 5})
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must be <= max_completion_tokens \(3\)"):
        req.to_sampling_params()
