"""A chat completion body read as servers other than OpenAI send it: the answer's text
in parts, usage blocks that say nonsense. A body that is no completion is an upstream
error (retried); one whose answer is there is never dropped for what its usage says."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from streams.errors import ContextOverflow, RateLimited, TaskError, Timeout, UpstreamError
from streams.llm.client import parse_completion


def _body(content: Any, usage: Any = None) -> bytes:
    return orjson.dumps({"model": "m", "usage": usage, "choices": [
        {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})  # fmt: skip


def test_an_answer_in_parts_is_its_text_parts() -> None:
    """Mistral's reasoning models: a `thinking` part, then the `text` one."""
    parts = [{"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]},
             {"type": "text", "text": '{"ok": '}, {"text": "true}"}, {"type": "image_url"}]  # fmt: skip
    assert parse_completion(_body(parts), "m").content == '{"ok": true}'
    assert parse_completion(_body(None), "m").content == ""  # nothing said: an empty answer


@pytest.mark.parametrize("content", [42, {"text": "{}"}, True])
def test_content_that_is_no_text_is_a_malformed_response(content: Any) -> None:
    with pytest.raises(UpstreamError) as caught:
        parse_completion(_body(content), "m")
    assert caught.value.code == "malformed_response"


@pytest.mark.parametrize(
    ("said", "count"),
    [(120, 120), (120.0, 120), ("120", 120), (-1, 0), ("many", 0), (True, 0), ([3], 0),
     ({"n": 3}, 0), (None, 0)],
)  # fmt: skip
def test_a_token_count_that_is_no_whole_number_of_zero_or_more_counts_as_unsaid(
    said: Any, count: int
) -> None:
    """A negative count made the task's spend and its counters fail: an internal error,
    and the answer, paid for, thrown away."""
    usage = {"prompt_tokens": said, "completion_tokens": said,
             "prompt_tokens_details": {"cached_tokens": said}}  # fmt: skip
    answer = parse_completion(_body('{"ok": true}', usage), "m")
    assert answer.content == '{"ok": true}'
    assert answer.prompt_tokens == answer.completion_tokens == answer.cached_prompt_tokens == count


@pytest.mark.parametrize(
    ("error", "raised", "code"),
    [
        ({"code": 429, "message": "Rate limit exceeded"}, RateLimited, "http_429"),
        ({"code": 502, "message": "provider returned error"}, UpstreamError, "http_502"),
        ({"code": 408, "message": "timed out"}, Timeout, "http_408"),
        ({"code": "context_length_exceeded", "message": "This model's maximum context length "
          "is 4096 tokens. However, you requested 5000 tokens"}, ContextOverflow,
         "context_length_exceeded"),
        ({"code": "server_error", "message": "boom"}, UpstreamError, "server_error"),
        ({"message": "no code at all"}, UpstreamError, "http_502"),
    ],
)  # fmt: skip
def test_an_error_in_a_200_answer_is_that_error_not_a_malformed_response(
    error: dict[str, Any], raised: type[TaskError], code: str
) -> None:
    """OpenRouter answers 200 once the model began and puts a later error in the body,
    its code the status it stands for. It was a `malformed_response`: a rate limit the
    limiter never heard, an overflow retried as if the server had failed."""
    with pytest.raises(raised) as found:
        parse_completion(orjson.dumps({"error": error, "id": "gen-1"}), "m")
    assert type(found.value) is raised and found.value.code == code
    assert str(error["message"])[:20] in found.value.message
    if raised is ContextOverflow:
        assert found.value.window == 4096  # the server's numbers, read as from any overflow
