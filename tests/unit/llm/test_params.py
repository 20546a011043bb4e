"""A version's `params`: Chat Completions fields as written, a server's own under
`extra_body`, nothing of llm-streams' own."""

from __future__ import annotations

from streams.llm.client import LLMRequest, request_body
from streams.llm.params import body_fields, params_problems


def test_chat_completions_fields_pass() -> None:
    assert params_problems({"temperature": 0, "max_completion_tokens": 400, "seed": 7,
                            "stop": ["\n\n"], "reasoning_effort": "low"}) == []  # fmt: skip


def test_a_typo_is_refused_with_the_nearest_name() -> None:
    (problem,) = params_problems({"temprature": 0})
    assert problem.startswith("params.temprature is no Chat Completions parameter")
    assert "did you mean temperature?" in problem


def test_a_servers_own_field_is_sent_under_extra_body() -> None:
    (problem,) = params_problems({"top_k": 40})
    assert "put it under params.extra_body" in problem
    assert params_problems({"extra_body": {"top_k": 40, "cache_prompt": True}}) == []
    assert params_problems({"extra_body": 3}) == [
        "params.extra_body must be a mapping of body fields"
    ]


def test_what_llm_streams_sets_is_refused_with_where_it_is_set() -> None:
    problems = params_problems({"response_format": {}, "stream": True, "n": 2,
                                "extra_body": {"model": "x"}})  # fmt: skip
    assert problems == [
        "params.extra_body.model: set from the version's `model` (or LLM_STREAMS_LLM__MODEL)",
        "params.n: not supported: one answer per call",
        "params.response_format: set from the version's `response_format`",
        "params.stream: not supported: answers are read whole",
    ]


def test_the_body_carries_extra_body_merged_and_never_over_model_or_messages() -> None:
    assert body_fields({"temperature": 0, "extra_body": {"top_k": 40}}) == {
        "temperature": 0, "top_k": 40,
    }  # fmt: skip
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="m",
                         params={"extra_body": {"min_p": 0.1, "model": "other"}})  # fmt: skip
    body = request_body(request)
    assert body["min_p"] == 0.1 and "extra_body" not in body
    assert body["model"] == "m" and body["messages"] == request.messages
