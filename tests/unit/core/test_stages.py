"""Multi-stage pipelines: a stage runs on the answers before it, when its condition holds;
a failed stage keeps the answers before it, and a re-run resumes from the failed stage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import yaml

from streams.contract.records import Source
from streams.core.processor import Prepared, TaskProcessor
from streams.core.spend import Prices
from streams.core.stages import still_made_of
from streams.dev.simulator import SimulatorServer
from streams.errors import ConfigError
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]
SRC = Source(topic="t", partition=0, offset=7)
REPLY_SCHEMA = orjson.loads((ROOT / "schemas" / "reply-draft.output.schema.json").read_bytes())
UNHAPPY = "The kettle broke on day two and the box was crushed. Terrible."
HAPPY = "Great kettle, I love it. Excellent value."


@pytest.fixture
async def processor(
    simulator: SimulatorServer, make_processor: MakeProcessor
) -> AsyncIterator[TaskProcessor]:
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=1)  # fmt: skip
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("sim", min_calls=1000))  # fmt: skip
    yield make_processor(
        guarded=guarded, prices=Prices(prompt_per_1k=1, completion_per_1k=1),
        policy=RetryPolicy(max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.002),
    )  # fmt: skip
    await client.close()


def prepared(processor: TaskProcessor, text: str) -> Prepared:
    task = {"task_id": "t1", "pipeline": "comment-triage", "input": {"text": text}}
    prep = processor.intake.prepare(orjson.dumps(task), b"t1", SRC)
    assert isinstance(prep, Prepared)
    return prep


def requests(simulator: SimulatorServer) -> int:
    return int(simulator.sim.snapshot()["requests"])


async def test_an_unhappy_comment_gets_a_reply_draft_stage(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    out = await processor.answer(prepared(processor, UNHAPPY))
    assert out.kind == "result", out.value
    output = orjson.loads(out.value)["output"]
    assert output["sentiment"] == "negative"
    jsonschema.validate(output["stages"]["reply"], REPLY_SCHEMA)
    assert requests(simulator) == 2
    assert out.attempts == 2 and out.stage == "reply"
    assert out.stages is not None and set(out.stages) == {"main", "reply"}


async def test_a_stage_whose_condition_fails_is_skipped(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    out = await processor.answer(prepared(processor, HAPPY))
    output = orjson.loads(out.value)["output"]
    assert output["sentiment"] == "positive" and output["stages"] == {"reply": None}
    assert requests(simulator) == 1


async def test_a_failed_stage_keeps_the_answers_before_it_and_resumes_from_itself(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    prep = prepared(processor, UNHAPPY)
    first = await processor.answer(prep)
    main = orjson.loads(first.value)["output"]
    main.pop("stages")
    simulator.sim.config.error_500_rate = 1.0  # the provider fails from here on
    before = requests(simulator)
    dead = await processor.answer(prep, earlier={"main": main})
    assert dead.kind == "dead_letter" and dead.stage == "reply"
    letter = orjson.loads(dead.value)
    assert letter["error"]["category"] == "upstream_error"
    assert letter["error"]["message"].startswith("stage reply: ")
    assert dead.stages == {"main": main}  # what the state keeps
    assert requests(simulator) - before == 2  # the stage's attempts only, not the first call
    simulator.sim.config.error_500_rate = 0.0
    before = requests(simulator)
    again = await processor.answer(prep, earlier=dead.stages)
    assert again.kind == "result" and requests(simulator) - before == 1
    output = orjson.loads(again.value)["output"]
    assert {k: v for k, v in output.items() if k != "stages"} == main
    jsonschema.validate(output["stages"]["reply"], REPLY_SCHEMA)


@pytest.mark.parametrize("when", ["output.no_such_field.deeper == 1",
                                  "output.sentiment > 1"])  # fmt: skip
async def test_a_stage_input_that_cannot_be_built_is_a_dead_letter(
    simulator: SimulatorServer,
    tmp_path: Path,
    processor: TaskProcessor,
    when: str,
    make_processor: MakeProcessor,
) -> None:
    """Jinja's own errors and what Python raises on the answer's values alike (here a
    TypeError: the sentiment is text)."""
    folder = _pipelines(tmp_path, when=when)
    registry = PipelineRegistry.load(folder, ROOT / "schemas")
    processor = make_processor(guarded=processor.client, registry=registry)
    out = await processor.answer(prepared(processor, UNHAPPY))
    letter = orjson.loads(out.value)
    assert out.kind == "dead_letter" and out.stage == "reply"
    assert (letter["error"]["category"], letter["error"]["code"]) == ("invalid_output",
                                                                     "stage_input")  # fmt: skip
    assert requests(simulator) == 1


def _pipelines(tmp_path: Path, **stage: Any) -> Path:
    folder = tmp_path / "pipelines"
    folder.mkdir(exist_ok=True)
    for name in ("comment-triage", "reply-draft", "comment-analysis"):
        spec = yaml.safe_load((ROOT / "pipelines" / f"{name}.yaml").read_text())
        if name == "comment-triage":
            spec["stages"][0].update(stage)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return folder


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ({"pipeline": "nope"}, "unknown pipeline 'nope'"),
        ({"pipeline": "comment-triage"}, "has stages itself"),
        ({"version": "v9"}, "has no version 'v9'"),
        ({"when": "output.sentiment in ["}, "expression error"),
        ({"name": "main"}, "not 'main'"),
    ],
)
def test_bad_stages_are_refused_at_load(
    tmp_path: Path, stage: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        PipelineRegistry.load(_pipelines(tmp_path, **stage), ROOT / "schemas")


def test_earlier_answers_are_used_up_to_the_first_stage_defined_otherwise_now() -> None:
    answers = {"main": {"a": 1}, "reply": {"b": 2}}
    then = {"main": "m1", "reply": "r1"}
    assert still_made_of(answers, then, {"main": "m1", "reply": "r1", "tag": "t1"}) == answers
    assert still_made_of(answers, then, {"main": "m1", "reply": "r2"}) == {"main": {"a": 1}}
    assert still_made_of(answers, then, {"main": "m2", "reply": "r1"}) == {}  # its input moved
    assert still_made_of(answers, None, {"main": "m2"}) == answers  # kept by an older release
