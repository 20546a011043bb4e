"""A chat completion body read as servers other than OpenAI send it: the answer's text
in parts, usage blocks that say nonsense, a refusal, a content filter. A body that is no
completion is an upstream error (retried); one whose answer is there is never dropped for
what its usage says."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from streams.contract.records import Source
from streams.core.spend import Prices
from streams.errors import ContextOverflow, RateLimited, TaskError, Timeout, UpstreamError
from streams.llm.client import parse_completion
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

SRC = Source(topic="t", partition=0, offset=7)


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


REFUSED = {"role": "assistant", "content": None, "refusal": "I can't help with that."}


@pytest.mark.parametrize(
    ("message", "finish", "code", "said"),
    [
        (REFUSED, "stop", "refusal", "I can't help with that."),  # OpenAI structured outputs
        ({"role": "assistant", "content": None}, "content_filter", "content_filter",
         "content filter"),  # OpenAI, Azure, Gemini's OpenAI API
        ({"role": "assistant", "content": '{"sentiment": "neg'}, "content_filter",
         "content_filter", "content filter"),  # cut off by the filter mid-answer
    ],
)  # fmt: skip
async def test_a_refused_or_filtered_answer_is_a_dead_letter_asked_once_and_paid(
    make_processor: MakeProcessor, message: dict[str, Any], finish: str, code: str, said: str
) -> None:
    """It was `answer is not JSON`: retried with a repair turn (paid again, refused again)
    and dead-lettered as a bad answer, the refusal's words lost."""
    raw = orjson.dumps({"model": "m", "choices": [{"message": message, "finish_reason": finish}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 9}})  # fmt: skip
    assert parse_completion(raw, "m").refusal == message.get("refusal")
    llm = FakeLLM(lambda _r: parse_completion(raw, "sim-1"))
    task = orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis",
                         "input": {"text": "Some comment."}})  # fmt: skip
    out = await make_processor(llm, prices=Prices(1.0, 2.0)).process(task, b"t1", SRC)
    assert out.kind == "dead_letter" and out.category == "invalid_output"
    letter = orjson.loads(out.value)
    assert letter["error"]["code"] == code and not letter["error"]["retryable"]
    assert said in letter["error"]["message"]
    assert len(llm.requests) == 1 and out.attempts == 1
    assert out.prompt_tokens == 100 and out.cost_usd > 0  # the call is booked
    assert out.rejected == 1  # counted as an answer the checks refused


@pytest.mark.parametrize("refusal", ["", "  ", None, False, 0, {}, ["no"]])
def test_a_refusal_that_says_nothing_leaves_the_answer(refusal: Any) -> None:
    """An empty refusal, or one in a shape a server other than OpenAI sends there."""
    raw = orjson.dumps({"model": "m", "choices": [{"finish_reason": "stop", "message": {
        "role": "assistant", "content": '{"ok": true}', "refusal": refusal}}]})  # fmt: skip
    answer = parse_completion(raw, "m")
    assert answer.refusal is None and answer.content == '{"ok": true}'


def test_a_fence_is_taken_off_as_before_the_pattern_was_split() -> None:
    """The fence's pattern was one for the whole answer and backtracked its language tag
    against the body: an answer of a fence and a long run of letters or blanks cost the
    square of the run (67 s for 100 KB). It finds what it found, on any text."""
    import random
    import re

    from streams.llm.client import unfenced

    before = re.compile(r"^\s*```[A-Za-z]*[ \t]*\n?(.*?)\n?```\s*$", re.DOTALL)
    rng = random.Random(1)
    parts = ["`", "```", "a", "json", "\n", " ", "\t", "{", "}", "\r", "\u3000", "x\n"]
    for _ in range(20_000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        found = before.match(text)
        assert unfenced(text) == (found.group(1) if found else text), repr(text)
    assert unfenced('```json\n{"ok": true}\n```\n') == '{"ok": true}'


async def test_model_names_answers_say_have_a_bounded_number_of_series(
    make_processor: MakeProcessor,
) -> None:
    """An answer names its model (a snapshot, the model a router chose, a server's file
    path): one series per name any answer brought, for `outputs_total` and
    `cost_usd_total`, grew without bound. The result still says the name as given."""
    from streams.observability.metrics import MODEL_LABELS

    names = iter(f"router-pick-{n}-" + "x" * 300 for n in range(MODEL_LABELS + 20))
    good = {"sentiment": "positive", "confidence": 0.9, "topics": [], "issues": [],
            "summary": "ok", "language": "en"}  # fmt: skip
    llm = FakeLLM(lambda _r: answer(good, model=next(names)))
    processor = make_processor(llm, prices=Prices(1.0, 2.0))
    for n in range(MODEL_LABELS + 20):
        task = orjson.dumps({"task_id": f"t{n}", "pipeline": "comment-analysis",
                             "input": {"text": f"Comment {n}."}})  # fmt: skip
        out = await processor.process(task, f"t{n}".encode(), SRC)
        assert orjson.loads(out.value)["model"].startswith(f"router-pick-{n}-")
    for metric in ("llm_streams_outputs", "llm_streams_cost_usd"):
        models = {s.labels["model"] for m in processor.metrics.registry.collect()
                  if m.name == metric for s in m.samples}  # fmt: skip
        assert len(models) == MODEL_LABELS + 1 and "other" in models, metric
        assert max(len(name) for name in models) <= 128


@pytest.mark.parametrize(
    ("content", "read"),
    [
        ('<think>\nA {"draft": 1} first.\n</think>\n\n{"ok": true}', {"ok": True}),
        ('Only the closing tag: the template opened it.</think>{"ok": true}', {"ok": True}),
        ('<think>hmm</think>\n```json\n{"ok": true}\n```', {"ok": True}),
        ('{"said": "</think>"}', {"said": "</think>"}),  # JSON as it is: read as it is
    ],
)  # fmt: skip
def test_an_answer_is_read_past_reasoning_before_it(content: str, read: Any) -> None:
    from streams.llm.client import json_answer

    assert json_answer(content) == read


def test_an_answer_of_reasoning_alone_is_no_json() -> None:
    from streams.llm.client import json_answer

    for content in ("<think>still thinking", "<think>done</think>", "plain words"):
        with pytest.raises(orjson.JSONDecodeError):
            json_answer(content)


@pytest.mark.parametrize(
    ("usage", "completion"),
    [
        # xAI: the reasoning beside the visible answer, the total the sum of the three.
        ({"prompt_tokens": 32, "completion_tokens": 9, "total_tokens": 135,
          "completion_tokens_details": {"reasoning_tokens": 94}}, 103),
        # OpenAI: the reasoning within completion_tokens; the total says so.
        ({"prompt_tokens": 32, "completion_tokens": 103, "total_tokens": 135,
          "completion_tokens_details": {"reasoning_tokens": 94}}, 103),
        # No total, or one that adds up otherwise: completion_tokens as said.
        ({"prompt_tokens": 32, "completion_tokens": 9,
          "completion_tokens_details": {"reasoning_tokens": 94}}, 9),
        ({"prompt_tokens": 32, "completion_tokens": 9, "total_tokens": 500,
          "completion_tokens_details": {"reasoning_tokens": 94}}, 9),
        ({"prompt_tokens": 32, "completion_tokens": 9, "total_tokens": 41,
          "completion_tokens_details": {"reasoning_tokens": "many"}}, 9),
    ],
)  # fmt: skip
def test_reasoning_counted_beside_the_answer_is_billed_with_it(
    usage: dict[str, Any], completion: int
) -> None:
    """xAI bills its reasoning tokens as completion tokens but reports them apart: the
    answer's cost (and the budgets held to it) left them out — 8x too low on a short
    answer after long thought."""
    assert parse_completion(_body('{"ok": true}', usage), "m").completion_tokens == completion


@pytest.mark.parametrize(
    ("content", "arguments"),
    [
        ("I'll analyse this comment.", '{"ok": true}'),  # words beside the forced call
        (None, {"ok": True}),  # arguments sent decoded, an object
        ("", '{"ok": true}'),
    ],
)  # fmt: skip
def test_a_forced_calls_arguments_are_the_answer(content: Any, arguments: Any) -> None:
    """The arguments were read only when the content was empty, and as `str()` of them:
    a model's words beside the call, or arguments sent as an object (Python's repr, not
    JSON), made every such answer `not_json` and a paid repair."""
    raw = orjson.dumps({"model": "m", "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": content, "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "answer", "arguments": arguments}}]}}]})  # fmt: skip
    answer = parse_completion(raw, "m")
    assert orjson.loads(answer.content) == {"ok": True} and answer.tool_called
