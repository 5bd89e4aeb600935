"""The HTTP API answers out-of-range fields in its own names and OpenAI's ranges (issue 21: `max_tokens: 0`
answered "Generate.max_tokens: Expected `int` >= 1 - at `$[2]`", and `temperature: 3` was accepted)."""

from __future__ import annotations

import pytest

from specrelay.common.errors import InvalidRequest
from specrelay.edge_worker.http.server import api


def refusal(body: bytes, kind=api.CompletionRequest) -> api.APIError:
    with pytest.raises(api.APIError) as caught:
        api.check(api.parse(body, kind), "specrelay")
    return caught.value


@pytest.mark.parametrize("body, param, words", [
    (b'{"model": "specrelay", "prompt": "x", "max_tokens": 0}', "max_tokens", "max_tokens must be at least 1"),
    (b'{"model": "specrelay", "prompt": "x", "temperature": 3}', "temperature", "between 0 and 2"),
    (b'{"model": "specrelay", "prompt": "x", "temperature": -0.5}', "temperature", "between 0 and 2"),
])
def test_out_of_range_fields_are_400_in_the_apis_own_words(body, param, words):
    error = refusal(body)
    assert error.status == 400 and error.param == param and words in str(error)


def test_chat_max_completion_tokens_below_one_is_refused():
    body = b'{"model": "specrelay", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}'
    assert refusal(body, api.ChatRequest).param == "max_completion_tokens"


def test_wire_validation_messages_lose_the_wire_names():
    error = api.as_api_error(InvalidRequest("Generate.max_new_tokens: Expected `int` <= 32768 - at `$[2]`",
                                            field="max_new_tokens"))
    assert str(error) == "max_tokens: Expected `int` <= 32768" and error.param == "max_tokens"
