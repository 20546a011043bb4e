"""The batch lane against the simulator's Files and Batch API, through the real SDK."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from streams.contract.lanes import Lane, Tier
from streams.contract.records import Source
from streams.core.batch import (
    BatchLane,
    Parked,
    Parking,
    Released,
    batch_key,
    error_of,
    item_key,
    job_key,
)
from streams.core.outcome import Outcome, Prepared
from streams.core.spend import Prices
from streams.dev.simulator import SimulatorServer
from streams.errors import BadRequest, Timeout, UpstreamError
from streams.llm.client import LLMRequest
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.clock import MonotonicClock
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy
from streams.settings import BatchApiSettings
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]


class LedgerStore:
    """The task store's ledger map in memory, counting writes."""

    def __init__(self) -> None:
        self.maps: dict[int, dict[bytes, bytes]] = {}
        self.writes = 0

    def get(self, partition: int, key: bytes) -> bytes | None:
        return self.maps.get(partition, {}).get(key)

    async def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.writes += 1
        if value is None:
            self.maps.setdefault(partition, {}).pop(key, None)
        else:
            self.maps.setdefault(partition, {})[key] = value

    async def durable(self, partition: int) -> None:
        return None  # acked is durable (at-least-once)

    def keys(self, partition: int, prefix: bytes) -> list[bytes]:
        return [k for k in self.maps.get(partition, {}) if k.startswith(prefix)]

    def owns(self, partition: int) -> bool:
        return True


class QuickClock(MonotonicClock):
    """The lane's waits (backoff, polls) cut to a few milliseconds."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(min(seconds, 0.01))


SETTINGS = BatchApiSettings(
    linger_s=0.05, poll_s=0.05, poll_max_s=0.2, max_items=50, intake_per_s=100_000
)


def _request(text: str) -> LLMRequest:
    return LLMRequest(
        messages=[{"role": "system", "content": "Analyse."},
                  {"role": "user", "content": f"<comment>{text}</comment>"}],
        model="sim-1", params={"max_tokens": 300}, response_format={"type": "json_object"},
    )  # fmt: skip


async def _created(simulator: SimulatorServer) -> None:
    """Until the simulator's Batch API holds a batch."""
    for _ in range(200):
        if simulator.sim.snapshot()["batches"]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no batch created")


@pytest.fixture
async def client(simulator: SimulatorServer) -> AsyncIterator[OpenAIClient]:
    simulator.sim.config.batch_delay_s = 0.2
    c = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=2, read_timeout_s=5
    )
    yield c
    await c.close()


async def test_requests_are_gathered_into_one_batch_and_answered_by_custom_id(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    store = LedgerStore()
    lane = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    texts = [f"Great blender {i}." if i % 2 else f"Broke on day {i}." for i in range(30)]
    answers = await asyncio.gather(*(
        lane.complete(0, f"rk-{i}", 1, _request(t)) for i, t in enumerate(texts)
    ))  # fmt: skip
    stats = simulator.sim.snapshot()
    assert stats["batches"] == 1 and stats["batch_items_submitted"] == 30
    assert stats["requests"] == 0  # no synchronous call
    for text, answer in zip(texts, answers, strict=True):
        output = orjson.loads(answer.content)
        assert output["sentiment"] == ("positive" if "Great" in text else "negative")
        assert answer.prompt_tokens > 0 and answer.completion_tokens > 0
    # The ledger knows the batch, done, and where each request went.
    (batch_raw,) = [v for k, v in store.maps[0].items() if k.startswith(b"batch/")]
    batch = orjson.loads(batch_raw)
    assert batch["state"] == "done" and batch["status"] == "completed"
    assert orjson.loads(store.maps[0][item_key("rk-3", 1)])["batch"] == batch["local_id"]
    await lane.close()


async def test_an_expired_batch_sends_its_unanswered_requests_again(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    simulator.sim.config.batch_expire_next = 1
    simulator.sim.config.batch_expire_fraction = 0.5
    lane = BatchLane(client, LedgerStore(), SETTINGS)  # type: ignore[arg-type]
    answers = await asyncio.gather(*(
        lane.complete(0, f"rk-{i}", 1, _request(f"Fine {i}.")) for i in range(20)
    ))  # fmt: skip
    assert len(answers) == 20
    batch_api = simulator.sim.batch
    assert simulator.sim.snapshot()["batches_by_status"] == {"expired": 1, "completed": 1}
    # Sent again only after its batch gave it no answer; never while one was pending.
    for custom_id, outcomes in batch_api.outcomes.items():
        assert outcomes in (["ok"], ["expired", "ok"]), (custom_id, outcomes)
        assert batch_api.submissions[custom_id] == len(outcomes)
    assert sum(1 for o in batch_api.outcomes.values() if o[0] == "expired") == 10
    await lane.close()


async def test_per_item_errors_come_back_in_the_taxonomy(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    simulator.sim.config.batch_item_error_rate = 1.0
    lane = BatchLane(client, LedgerStore(), SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(UpstreamError, match="HTTP 500"):
        await lane.complete(0, "rk-x", 1, _request("Fine."))
    assert (
        error_of(
            {
                "custom_id": "a",
                "response": {
                    "status_code": 400,
                    "body": {"error": {"message": "bad", "code": "invalid"}},
                },
            }
        ).category.value
        == "bad_request"
    )  # type: ignore[union-attr]
    await lane.close()


@pytest.mark.parametrize(
    "broken",
    [
        {"status_code": 200, "body": {"choices": []}},  # no completion in a 200
        {"status_code": 200, "body": "upstream said no"},
        {"status_code": "OK", "body": {}},
        "a gateway's text",
        {"status_code": 502, "body": {"error": "bad gateway"}},  # its error a text
    ],
)  # fmt: skip
async def test_a_broken_line_gets_its_error_and_spoils_no_other_answer(
    client: OpenAIClient,
    simulator: SimulatorServer,
    monkeypatch: pytest.MonkeyPatch,
    broken: object,
) -> None:
    """A line of the output file that is no completion raised while the batch's answers
    were handed out: the requests after it in the batch lost their answers (paid for)
    and were failed as `batch_lane_error`, to be asked — and paid for — again."""
    answered = simulator.sim.batch._answered
    lines = itertools.count()

    def one_broken(request: dict[str, object]) -> object:
        good = answered(request)  # type: ignore[arg-type]
        return broken if next(lines) == 0 else good

    monkeypatch.setattr(simulator.sim.batch, "_answered", one_broken)
    lane = BatchLane(client, LedgerStore(), SETTINGS)  # type: ignore[arg-type]
    answers = await asyncio.gather(
        *(lane.complete(0, f"rk-{i}", 1, _request(f"Fine {i}.")) for i in range(6)),
        return_exceptions=True,
    )
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], UpstreamError), answers
    assert failed[0].code != "batch_lane_error"
    assert all(not isinstance(a, BaseException) and a.content for a in answers if a not in failed)
    await lane.close()


async def test_a_restarted_worker_waits_for_the_batch_it_finds_in_the_ledger(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    simulator.sim.config.batch_delay_s = 0.6
    store = LedgerStore()
    first = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    running = [asyncio.create_task(first.complete(0, f"rk-{i}", 1, _request(f"Ok {i}.")))
               for i in range(5)]  # fmt: skip
    await _created(simulator)  # the batch is created ...
    await asyncio.sleep(0.1)
    for task in running:  # ... and the worker dies
        task.cancel()
    await first.close()
    second = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]  # same ledger
    answers = await asyncio.gather(*(
        second.complete(0, f"rk-{i}", 1, _request(f"Ok {i}.")) for i in range(5)
    ))  # fmt: skip
    assert len(answers) == 5
    assert simulator.sim.snapshot()["batches"] == 1  # no second batch
    assert all(n == 1 for n in simulator.sim.batch.submissions.values())
    # A request the ledger has in a finished batch is answered from its files, again.
    third = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    again = await third.complete(0, "rk-2", 1, _request("Ok 2."))
    assert again.content == answers[2].content
    assert simulator.sim.snapshot()["batches"] == 1
    await second.close()
    await third.close()


async def test_a_batch_recorded_but_never_created_is_abandoned_and_sent_anew(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    store = LedgerStore()
    # The worker wrote the batch to the ledger and died before creating it.
    store.maps[0] = {
        batch_key("lost"): orjson.dumps({"local_id": "lost", "partition": 0,
                                         "items": [["rk-1", 1]], "tokens": 10,
                                         "created_at": 0.0, "state": "creating"}),
        item_key("rk-1", 1): orjson.dumps({"batch": "lost"}),
    }  # fmt: skip
    lane = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    answer = await lane.complete(0, "rk-1", 1, _request("Fine."))
    assert orjson.loads(answer.content)["sentiment"]
    assert orjson.loads(store.maps[0][batch_key("lost")])["state"] == "abandoned"
    assert simulator.sim.snapshot()["batches"] == 1
    await lane.close()


async def test_the_enqueued_token_limit_holds_later_batches_back(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    settings = SETTINGS.model_copy(update={"max_items": 5, "max_enqueued_tokens": 2_000})
    lane = BatchLane(client, LedgerStore(), settings)  # type: ignore[arg-type]
    answers = await asyncio.gather(*(
        lane.complete(0, f"rk-{i}", 1, _request(f"Fine {i}.")) for i in range(15)
    ))  # fmt: skip
    assert len(answers) == 15
    batches = simulator.sim.batch.batches.values()
    assert len(batches) == 3
    # One batch at a time (each ~1,700 tokens with its budgets): never two in progress.
    spans = sorted((b.created_at, b.finished_at or 0) for b in batches)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans))
    await lane.close()


async def test_the_processor_answers_a_batch_tier_task_at_the_batch_price(
    client: OpenAIClient, simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    processor = make_processor(
        client, registry=registry, limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("s"),
        policy=RetryPolicy(max_attempts=3, backoff_base_s=0.01),
        deadline_s=0.05,  # far too short for a batch: the batch tier has its own deadline
        prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0), batch_deadline_s=60,
    )  # fmt: skip
    processor.batches = BatchLane(client, LedgerStore(), SETTINGS)  # type: ignore[arg-type]
    raw = orjson.dumps({"task_id": "b1", "pipeline": "comment-analysis",
                        "input": {"text": "Arrived late, works great."}})  # fmt: skip
    prep = processor.intake.prepare(raw, None, Source(topic="r", partition=0, offset=1))
    assert not isinstance(prep, type(None))
    batch_out = await processor.answer(prep, Lane.REPLAY, None, Tier.BATCH)
    assert batch_out.kind == "result", orjson.loads(batch_out.value)
    assert simulator.sim.snapshot()["requests"] == 0
    result = orjson.loads(batch_out.value)
    full = Prices(1.0, 2.0).cost(
        result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]
    )
    assert result["cost_usd"] == pytest.approx(full * 0.5)
    # A provider whose batch lines say no usage: counted here, priced all the same.
    simulator.sim.config.usage = "none"
    other = processor.intake.prepare(raw.replace(b'"b1"', b'"b2"'), None,
                                     Source(topic="r", partition=0, offset=2))  # fmt: skip
    assert not isinstance(other, Outcome)
    unsaid = orjson.loads((await processor.answer(other, Lane.REPLAY, None, Tier.BATCH)).value)
    assert unsaid["usage"]["prompt_tokens"] == result["usage"]["prompt_tokens"]
    assert unsaid["cost_usd"] > 0 and unsaid["usage"]["completion_tokens"] > 0
    simulator.sim.config.usage = "said"
    # Batch is for the replay lane only: a live task asking for it is answered in a call.
    lane = processor.batches
    processor = make_processor(client, registry=registry, limiter=RateLimiter(rpm=None),
                               prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0))  # fmt: skip
    processor.batches = lane
    live = await processor.answer(prep, Lane.LIVE, None, Tier.BATCH)
    assert live.kind == "result" and simulator.sim.snapshot()["requests"] == 1
    assert orjson.loads(live.value)["cost_usd"] == pytest.approx(full)
    await processor.batches.close()


async def test_the_flex_tier_calls_at_the_batch_price_and_falls_back_when_it_has_no_room(
    client: OpenAIClient, simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    limiter = RateLimiter(rpm=None)
    processor = make_processor(
        client, registry=registry, limiter=limiter, breaker=CircuitBreaker("s"),
        policy=RetryPolicy(max_attempts=3, backoff_base_s=0.01), deadline_s=10,
        prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0),
    )  # fmt: skip
    raw = orjson.dumps({"task_id": "f1", "pipeline": "comment-analysis",
                        "input": {"text": "Works great."}})  # fmt: skip
    prep = processor.intake.prepare(raw, None, Source(topic="r", partition=0, offset=1))
    flex = await processor.answer(prep, Lane.REPLAY, None, Tier.FLEX)
    result = orjson.loads(flex.value)
    full = Prices(1.0, 2.0).cost(
        result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]
    )
    assert result["cost_usd"] == pytest.approx(full * 0.5)
    assert simulator.sim.snapshot()["by_outcome"] == {"ok_flex": 1}
    # No flex capacity: the task goes on as a plain call, at the plain price; the 429 is
    # not taken for a rate limit.
    simulator.sim.config.flex_unavailable_rate = 1.0
    rate_before, paused_before = limiter.requests.per_minute, limiter.paused_until
    fallback = await processor.answer(prep, Lane.REPLAY, None, "flex")  # type: ignore[arg-type]
    result = orjson.loads(fallback.value)
    assert fallback.kind == "result" and result["attempts"] == 2
    assert result["cost_usd"] == pytest.approx(full)
    assert simulator.sim.snapshot()["by_outcome"] == {"ok_flex": 1, "flex_unavailable": 1, "ok": 1}
    assert limiter.requests.per_minute == rate_before and limiter.paused_until == paused_before


async def test_a_batch_over_the_providers_token_limit_alone_fails_its_requests_clearly(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    simulator.sim.config.batch_token_limit = 100  # far below one request's estimate
    lane = BatchLane(client, LedgerStore(), SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="alone is over the provider's enqueued-token limit"):
        await lane.complete(0, "rk-big", 1, _request("Fine."))
    assert simulator.sim.snapshot()["batches_by_status"] == {"failed": 1}  # not sent again
    await lane.close()


async def test_a_batch_that_cannot_be_created_fails_its_requests(
    client: OpenAIClient, simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(data: bytes, name: str) -> str:
        raise UpstreamError("HTTP 503: files API down", code="http_503")

    monkeypatch.setattr(client, "upload_batch_file", refused)
    store = LedgerStore()
    lane = BatchLane(client, store, SETTINGS, clock=QuickClock())  # type: ignore[arg-type]
    with pytest.raises(UpstreamError, match="files API down"):
        await lane.complete(0, "rk-1", 1, _request("Fine."))
    # The ledger says the batch was never submitted, so a re-run sends it anew.
    (record,) = [orjson.loads(v) for k, v in store.maps[0].items() if k.startswith(b"batch/")]
    assert (record["state"], record["status"]) == ("done", "not_submitted")
    await lane.close()


class GoneLedger(LedgerStore):
    """A ledger whose writes never become durable (exactly-once: the partition was lost
    before its transaction committed)."""

    async def durable(self, partition: int) -> None:
        raise RuntimeError("partition 0: its transaction did not commit")


async def _parked(lane: BatchLane, key: str, text: str) -> None:
    await lane.complete(
        0, key, 1, _request(text), Parking(key, lambda: f"record of {key}".encode())
    )


async def test_a_parked_job_ends_once_its_request_is_in_the_ledger_and_runs_again_at_the_end(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    simulator.sim.config.batch_delay_s = 0.5
    store = LedgerStore()
    lane = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    resumed: list[tuple[int, str, bytes]] = []
    lane.resume = lambda p, key, record: resumed.append((p, key, record))
    ended = await asyncio.gather(*(_parked(lane, f"rk-{i}", f"Fine {i}.") for i in range(3)),
                                 return_exceptions=True)  # fmt: skip
    for i, exc in enumerate(ended):  # each job ended with Parked, its record in the ledger
        assert isinstance(exc, Parked), exc
        assert store.maps[0][job_key(f"rk-{i}")] == f"record of rk-{i}".encode()
    assert not resumed  # the batch still runs
    for _ in range(300):
        if len(resumed) == 3:
            break
        await asyncio.sleep(0.02)
    assert sorted(resumed) == [(0, f"rk-{i}", f"record of rk-{i}".encode()) for i in range(3)]
    # Run again, each finds its answer in the finished batch: nothing sent again.
    again = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]  # another worker
    answer = await again.complete(
        0, "rk-1", 1, _request("Fine 1."), Parking("rk-1", lambda: b"record of rk-1")
    )
    assert orjson.loads(answer.content)["sentiment"]
    assert simulator.sim.snapshot()["batches"] == 1
    assert all(n == 1 for n in simulator.sim.batch.submissions.values())
    await lane.close()
    await again.close()


async def test_a_new_owner_resumes_every_parked_job_and_follows_the_batch_in_flight(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    simulator.sim.config.batch_delay_s = 0.5
    store = LedgerStore()
    first = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    ended = await asyncio.gather(*(_parked(first, f"rk-{i}", f"Fine {i}.") for i in range(4)),
                                 return_exceptions=True)  # fmt: skip
    assert all(isinstance(exc, Parked) for exc in ended), ended
    await _created(simulator)  # the batch is created ...
    await asyncio.sleep(0.05)
    await first.close()  # ... and the worker dies with it in flight
    second = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    resumed: list[str] = []

    def resume(p: int, key: str, record: bytes) -> None:
        resumed.append(key)
        asyncio.get_running_loop().create_task(_parked(second, key, "ignored"))

    second.resume = resume
    second.resume_parked(0)  # the partition is new to it: every parked job runs again
    for _ in range(300):  # once resumed, they park on the batch; at its end, again
        if len(resumed) == 8:
            break
        await asyncio.sleep(0.02)
    assert sorted(resumed) == sorted([f"rk-{i}" for i in range(4)] * 2)
    assert simulator.sim.snapshot()["batches"] == 1  # followed, not sent again
    assert all(n == 1 for n in simulator.sim.batch.submissions.values())
    await second.close()


async def test_a_job_whose_request_cannot_be_made_durable_waits_for_its_answer(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    store = GoneLedger()
    lane = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(UpstreamError, match="did not commit"):  # never created: not paid
        await _parked(lane, "rk-1", "Fine.")
    assert simulator.sim.snapshot()["batches"] == 0
    assert job_key("rk-1") not in store.maps.get(0, {})
    await lane.close()


class SlowJobs(LedgerStore):
    """Writes a parked job's record only once the batch its request is in has ended."""

    async def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        if key.startswith(b"job/"):
            for _ in range(500):
                raw = [v for k, v in self.maps[partition].items() if k.startswith(b"batch/")]
                if raw and orjson.loads(raw[0])["state"] == "done":
                    break
                await asyncio.sleep(0.01)
        await super().put(partition, key, value)


async def test_a_job_parking_while_its_batch_ends_takes_the_answer_instead(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    """The batch's end resumed the jobs parked on it before this one's record was in the
    ledger: this job must not park (nothing would resume it); it takes the answer."""
    simulator.sim.config.batch_delay_s = 0.3
    store = SlowJobs()
    first = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]  # the dead worker
    waiting = asyncio.create_task(first.complete(0, "rk-1", 1, _request("Fine.")))
    for _ in range(200):
        batches = [k for k in store.maps.get(0, {}) if k.startswith(b"batch/")]
        if batches and orjson.loads(store.maps[0][batches[0]])["state"] == "submitted":
            break
        await asyncio.sleep(0.02)
    waiting.cancel()
    await first.close()
    second = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    resumed: list[str] = []
    second.resume = lambda p, key, record: resumed.append(key)
    answer = await second.complete(
        0, "rk-1", 1, _request("Fine."), Parking("rk-1", lambda: b"the record")
    )
    assert orjson.loads(answer.content)["sentiment"]
    assert simulator.sim.snapshot()["batches"] == 1
    await second.close()


async def test_a_record_too_big_for_the_ledger_is_not_parked_its_job_waits_for_the_answer(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    store = LedgerStore()
    lane = BatchLane(client, store, SETTINGS, ledger_bytes=4096)  # type: ignore[arg-type]
    answer = await lane.complete(
        0, "rk-1", 1, _request("Fine."), Parking("rk-1", lambda: b"x" * 5000)
    )  # no Parked
    assert orjson.loads(answer.content)["sentiment"]
    assert job_key("rk-1") not in store.maps[0]  # nothing written the topic would refuse
    assert simulator.sim.snapshot()["batches"] == 1
    await lane.close()


async def test_a_create_answered_502_after_the_provider_made_the_batch_makes_no_second_one(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    """The provider made the batch and its answer was lost (a gateway's 502): the retry
    asks for the batch by its metadata first, finds it and follows it."""
    simulator.sim.config.batch_create_lost_next = 1
    store = LedgerStore()
    lane = BatchLane(client, store, SETTINGS, clock=QuickClock())  # type: ignore[arg-type]
    answers = await asyncio.gather(*(
        lane.complete(0, f"rk-{i}", 1, _request(f"Fine {i}.")) for i in range(3)
    ))  # fmt: skip
    assert all(orjson.loads(a.content)["sentiment"] for a in answers)
    assert simulator.sim.snapshot()["batches"] == 1  # exactly one batch at the provider
    assert all(n == 1 for n in simulator.sim.batch.submissions.values())
    (record,) = [orjson.loads(v) for k, v in store.maps[0].items() if k.startswith(b"batch/")]
    assert (record["state"], record["status"]) == ("done", "completed")
    await lane.close()


async def test_a_create_that_timed_out_after_the_provider_made_the_batch_makes_no_second_one(
    client: OpenAIClient, simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every try times out after the provider made its batch: the lane does not take
    that for "not created" (before, the next attempt went into a second batch while the
    first ran, unfollowed and paid for); it finds the first and follows it."""
    real = client.create_batch

    async def made_then_timed_out(file_id: str, metadata: dict[str, str]) -> dict[str, object]:
        await real(file_id, metadata)
        raise Timeout("LLM call timed out", code="timeout")

    monkeypatch.setattr(client, "create_batch", made_then_timed_out)
    lane = BatchLane(client, LedgerStore(), SETTINGS, clock=QuickClock())  # type: ignore[arg-type]
    answer = await lane.complete(0, "rk-1", 1, _request("Fine."))
    assert orjson.loads(answer.content)["sentiment"]
    assert simulator.sim.snapshot()["batches"] == 1
    await lane.close()


async def test_a_create_lost_before_the_provider_made_anything_is_sent_anew_after_the_grace(
    client: OpenAIClient, simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every try of the create was lost on its way (the provider made nothing): the
    batch is followed as one whose creator died, not found within the grace, abandoned,
    and its request sent in a new batch — one batch at the provider in all."""
    real, lost = client.create_batch, [0]

    async def lost_on_the_way(file_id: str, metadata: dict[str, str]) -> dict[str, object]:
        if lost[0] < 5:  # every try of the first batch
            lost[0] += 1
            raise UpstreamError("cannot reach the LLM endpoint", code="connection_error")
        return await real(file_id, metadata)

    monkeypatch.setattr(client, "create_batch", lost_on_the_way)
    monkeypatch.setattr("streams.core.batch.remote.CREATE_GRACE_S", 0.3)
    store = LedgerStore()
    lane = BatchLane(client, store, SETTINGS, clock=QuickClock())  # type: ignore[arg-type]
    answer = await lane.complete(0, "rk-1", 1, _request("Fine."))
    assert orjson.loads(answer.content)["sentiment"]
    states = sorted(orjson.loads(v)["state"] for k, v in store.maps[0].items()
                    if k.startswith(b"batch/"))  # fmt: skip
    assert states == ["abandoned", "done"]
    assert simulator.sim.snapshot()["batches"] == 1
    await lane.close()


async def test_a_provider_failing_while_a_batch_runs_gives_its_requests_no_error(
    client: OpenAIClient, simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polls and file reads that fail for a while are asked again: the batch was paid
    for, and a request given an error would be asked again in a second batch."""
    failures = {"retrieve_batch": 3, "file_content": 2}
    for name in failures:
        real = getattr(client, name)

        async def flaky(*args: object, _real: object = real, _name: str = name) -> object:
            if failures[_name] > 0:
                failures[_name] -= 1
                raise Timeout(f"{_name} timed out", code="timeout")
            return await _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(client, name, flaky)
    lane = BatchLane(client, LedgerStore(), SETTINGS, clock=QuickClock())  # type: ignore[arg-type]
    answers = await asyncio.gather(*(
        lane.complete(0, f"rk-{i}", 1, _request(f"Fine {i}.")) for i in range(3)
    ))  # fmt: skip
    assert len(answers) == 3 and failures == {"retrieve_batch": 0, "file_content": 0}
    assert simulator.sim.snapshot()["batches"] == 1
    await lane.close()


async def test_a_batch_tier_record_too_large_to_park_is_answered_by_a_call(
    client: OpenAIClient, simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    """Parked, a record waits in the ledger and is acked; one the ledger cannot take
    would wait for its batch unacked — up to its 24-h window, holding every rebalance
    that long. It is answered by a call instead, at the full price, and counted."""
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    processor = make_processor(
        client, registry=registry, limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("s"),
        prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0), batch_deadline_s=60,
    )  # fmt: skip
    processor.batches = BatchLane(client, LedgerStore(), SETTINGS, ledger_bytes=4096)  # type: ignore[arg-type]
    raw = orjson.dumps({"task_id": "b1", "pipeline": "comment-analysis",
                        "input": {"text": "Arrived late, works great."}})  # fmt: skip
    prep = processor.intake.prepare(raw, None, Source(topic="r", partition=0, offset=1))
    assert isinstance(prep, Prepared)
    prep = replace(prep, record=lambda: b"x" * 5000)  # the edge's record, over the ledger's room
    out = await processor.answer(prep, Lane.REPLAY, None, Tier.BATCH)
    result = orjson.loads(out.value)
    assert out.kind == "result"
    assert simulator.sim.snapshot()["batches"] == 0 and simulator.sim.snapshot()["requests"] == 1
    full = Prices(1.0, 2.0).cost(
        result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]
    )
    assert result["cost_usd"] == pytest.approx(full)
    assert processor.metrics.mitigations.labels("*", "batch_unparkable")._value.get() == 1
    await processor.batches.close()


class LostLedger(LedgerStore):
    """A ledger whose partition 0 is given away when `lose()` is called: reads of it then
    answer nothing, as the task store's do for a partition it released."""

    def __init__(self) -> None:
        super().__init__()
        self.owned = True

    def lose(self) -> None:
        self.owned = False
        self.maps.pop(0, None)

    def get(self, partition: int, key: bytes) -> bytes | None:
        return super().get(partition, key) if self.owned else None

    def owns(self, partition: int) -> bool:
        return self.owned


async def test_a_job_whose_partition_was_given_away_asks_the_provider_nothing(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    """A resumed parked job run on after its partition was revoked: the store answers
    nothing for it, which read as "never sent" made a second batch (paid twice) for a
    partition the worker no longer owns. It ends as Released instead: the new owner runs
    the record."""
    store = LostLedger()
    lane = BatchLane(client, store, SETTINGS)  # type: ignore[arg-type]
    await lane.complete(0, "rk-0", 1, _request("Fine."))  # one batch, answered
    store.lose()
    with pytest.raises(Released):
        await lane.complete(0, "rk-0", 1, _request("Fine."))
    assert simulator.sim.snapshot()["batches"] == 1
    await lane.close()


async def test_requests_of_a_partition_lost_before_their_batch_is_created_are_not_sent(
    client: OpenAIClient, simulator: SimulatorServer
) -> None:
    store = LostLedger()
    lane = BatchLane(client, store, SETTINGS.model_copy(update={"linger_s": 0.3}))  # type: ignore[arg-type]
    waiting = asyncio.create_task(lane.complete(0, "rk-1", 1, _request("Fine.")))
    await asyncio.sleep(0.05)  # queued, its batch not flushed yet
    store.lose()
    with pytest.raises(Released):
        await waiting
    assert simulator.sim.snapshot()["batches"] == 0
    await lane.close()


async def test_a_batch_answers_tokens_are_counted_under_the_model_asked_as_a_calls_are(
    client: OpenAIClient, make_processor: MakeProcessor
) -> None:
    """A batch line's body names the model that answered as the provider names it (OpenAI:
    its dated snapshot): its tokens were counted under that name, a call's under the
    model asked — one model's tokens in two series, depending on the lane."""
    from streams.llm.client import LLMResponse

    class Answering:
        def takes(self, _parking: object) -> bool:
            return True

        async def complete(self, *_args: object, **_kw: object) -> LLMResponse:
            good = {"sentiment": "mixed", "confidence": 0.8, "topics": ["delivery"],
                    "issues": [], "summary": "Late, works.", "language": "en"}  # fmt: skip
            return LLMResponse(content=orjson.dumps(good).decode(),
                               model="sim-1-2024-07-18", prompt_tokens=50,
                               completion_tokens=20, finish_reason="stop")  # fmt: skip

        async def close(self) -> None:
            return None

    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    processor = make_processor(client, registry=registry, limiter=RateLimiter(rpm=None),
                               batch_deadline_s=60)  # fmt: skip
    processor.batches = Answering()  # type: ignore[assignment]
    raw = orjson.dumps({"task_id": "b1", "pipeline": "comment-analysis",
                        "input": {"text": "Arrived late, works great."}})  # fmt: skip
    prep = processor.intake.prepare(raw, None, Source(topic="r", partition=0, offset=1))
    assert not isinstance(prep, Outcome)
    out = await processor.answer(prep, Lane.REPLAY, None, Tier.BATCH)
    assert out.kind == "result", orjson.loads(out.value)
    sample = processor.metrics.registry.get_sample_value
    assert sample("llm_streams_tokens_total", {"model": "sim-1", "kind": "prompt"}) == 50
    assert (
        sample("llm_streams_tokens_total", {"model": "sim-1-2024-07-18", "kind": "prompt"}) is None
    )
