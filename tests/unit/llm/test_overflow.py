"""A prompt over the window, in every known server's words, is a context_overflow with
the server's numbers; anything else stays what it was."""

from __future__ import annotations

import pytest

from streams.errors import AuthError, BadRequest, ContextOverflow, UpstreamError
from streams.llm.client import error_for_status

LLAMA_BODY = {"error": {"code": 400, "message": "request (4670 tokens) exceeds the available "
              "context size (4096 tokens), try increasing it", "type": "exceed_context_size_error",
              "n_prompt_tokens": 4670, "n_ctx": 4096}}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "code", "message", "body", "window", "prompt"),
    [
        (400, "context_length_exceeded", "This model's maximum context length is 8192 tokens. "
         "However, you requested 9000 tokens (8600 in the messages, 400 in the completion).",
         None, 8192, 8600),
        (400, None, LLAMA_BODY["error"]["message"], LLAMA_BODY, 4096, 4670),
        (500, None, "the request exceeds the available context size (2048 tokens)", None,
         2048, None),
        (400, None, "This model's maximum context length is 4096 tokens and your request has "
         "3500 input tokens (1000 > 4096 - 3500).", None, 4096, 3500),
        (400, None, "The decoder prompt (length 5000) is longer than the maximum model length "
         "of 4096. Make sure that `max_model_len` is no smaller than the number of text "
         "tokens.", None, 4096, 5000),
        (422, None, "Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
         "4096. Given: 5000 `inputs` tokens and 100 `max_new_tokens`", None, 4096, 5000),
        (400, None, "prompt is too long: 210000 tokens > 200000 maximum", None, 200000, 210000),
        (400, None, "Prompt contains 40000 tokens and 0 draft tokens, too large for model "
         "with 32768 maximum context length", None, 32768, 40000),
        (400, None, "The input token count (1200000) exceeds the maximum number of tokens "
         "allowed (1048576).", None, 1048576, 1200000),
        (400, None, "litellm.ContextWindowExceededError: litellm.BadRequestError: "
         "ContextWindowExceededError: OpenAIException - maximum context length is 16385 "
         "tokens", None, 16385, None),
        (500, None, "the input length exceeds the context length", None, None, None),
    ],
)  # fmt: skip
def test_every_known_overflow_shape_is_a_context_overflow_with_its_numbers(
    status: int, code: str | None, message: str, body: object, window: int | None,
    prompt: int | None,
) -> None:  # fmt: skip
    error = error_for_status(status, code, message, body=body)
    assert isinstance(error, ContextOverflow), (status, message)
    assert (error.window, error.prompt_tokens) == (window, prompt)
    assert error.code == "context_length_exceeded" and not error.retryable


def test_other_refusals_keep_their_category() -> None:
    assert isinstance(error_for_status(400, "invalid_value", "temperature must be <= 2"),
                      BadRequest)  # fmt: skip
    assert isinstance(error_for_status(401, None, "context window of the key expired"), AuthError)
    assert isinstance(error_for_status(503, None, "Loading model"), UpstreamError)
