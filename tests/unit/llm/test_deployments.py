"""Deployments: a model served by several endpoints and keys, each at its own limits,
health and price; calls routed by headroom (on the simulator, three deployments at once:
bearer, Azure-style, and one that fails)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.api import Analyzer
from streams.contract.lanes import Lane, Tier
from streams.core.outcome import Outcome
from streams.core.spend import Prices, Spend, Tokens
from streams.dev.simulator import SimConfig, SimulatorServer
from streams.errors import ConfigError
from streams.llm.client import LLMResponse
from streams.llm.deployments import load_deployments
from streams.observability.page import render_html
from streams.observability.status import StatusView
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.router import Member, Route, prefix_of
from streams.settings import Settings, load_settings
from tests.fakes import FakeLLM

ROOT = Path(__file__).resolve().parents[3]


def tasks(first: int, n: int) -> list[dict[str, Any]]:
    """`n` comment-analysis tasks, numbered from `first`."""
    return [{"task_id": f"t-{i}", "pipeline": "comment-analysis",
             "input": {"text": f"Comment number {i}: works fine."}}
            for i in range(first, first + n)]  # fmt: skip


def breaker_states(analyzer: Analyzer) -> dict[str, float]:
    """Each breaker's state as the metrics say (0 closed, 1 half-open, 2 open), by name."""
    return {sample.labels["endpoint"]: sample.value
            for family in analyzer.metrics.breaker_state.collect()
            for sample in family.samples}  # fmt: skip


def write(tmp_path: Path, deployments: list[dict[str, Any]]) -> Path:
    path = tmp_path / "deployments.yaml"
    path.write_text(yaml.safe_dump({"deployments": deployments}))
    return path


def test_a_deployments_file_is_read_with_its_keys_from_env_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAST_KEY", "sk-east-secret")
    (tmp_path / "west.key").write_text("sk-west-secret\n")
    path = write(tmp_path, [
        {"name": "east", "model": "gpt-4o-mini", "base_url": "http://east/v1",
         "api_key_env": "EAST_KEY", "rpm": 3000, "price_per_1k_prompt_usd": 0.1},
        {"name": "west", "model": "gpt-4o-mini", "auth": "azure", "base_url": "http://west",
         "provider_model": "mini-prod", "api_version": "2024-10-21",
         "api_key_file": str(tmp_path / "west.key"), "headers": {"X-Team": "reviews"}},
    ])  # fmt: skip
    east, west = load_deployments(path)
    assert (east.name, east.api_key, east.provider_model, east.azure) == (
        "east", "sk-east-secret", "gpt-4o-mini", None)  # fmt: skip
    assert west.api_key == "sk-west-secret" and west.azure is not None
    assert (west.azure.endpoint, west.azure.deployment, west.azure.api_version) == (
        "http://west", "mini-prod", "2024-10-21")  # fmt: skip
    assert "secret" not in repr(east) + repr(west)  # keys never printed


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"name": "a", "model": "m", "base_url": "http://a", "rpmm": 5},
         "deployments.0.rpmm: unknown field (did you mean rpm?)"),
        ({"name": "a", "model": "m", "auth": "azure", "base_url": "http://a"},
         "auth: azure needs base_url (the resource) and api_version"),
        ({"name": "a", "model": "m", "api_key_env": "NOT_SET_ANYWHERE_42"},
         "deployment a: NOT_SET_ANYWHERE_42 is not set"),
        ({"name": "default", "model": "m"}, "the name of OPENAI_BASE_URL's deployment"),
        ({"name": "a", "model": "m", "weight": float("inf")}, "weight: Input should be a finite"),
        ({"name": "a", "model": "m", "usd_per_day": float("inf")}, "usd_per_day: Input should be a finite"),
    ],
)  # fmt: skip
def test_a_mistake_in_a_deployments_file_is_said_by_its_field(
    tmp_path: Path, entry: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError, match="LLM_STREAMS_LLM__DEPLOYMENTS_FILE") as caught:
        load_deployments(write(tmp_path, [entry]))
    assert said in str(caught.value)


def test_names_must_be_unique(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unique: a twice"):
        load_deployments(write(tmp_path, [{"name": "a", "model": "m"}] * 2))


def test_each_deployments_tokens_cost_its_own_price(tmp_path: Path) -> None:
    path = write(tmp_path, [
        {"name": "cheap", "model": "m", "price_per_1k_prompt_usd": 1.0,
         "price_per_1k_completion_usd": 2.0},
        {"name": "dear", "model": "m", "price_per_1k_prompt_usd": 10.0},
    ])  # fmt: skip
    settings = load_settings(llm={"price_per_1k_prompt_usd": 0.5,
                                  "price_per_1k_completion_usd": 0.5})  # fmt: skip
    prices = Prices.from_settings(settings, load_deployments(path))
    spend = Spend()
    spend.took(LLMResponse("{}", "m", 1000, 1000, "stop", deployment="cheap"))
    spend.took(LLMResponse("{}", "m", 1000, 1000, "stop", deployment="dear"))
    spend.used(Tokens(1000, 0), "m")  # no deployment named: the llm's price
    # cheap: 1 + 2; dear: 10 + 0.5 (its completion price is the llm's); the rest: 0.5.
    assert prices.split(spend) == pytest.approx({"cheap": 3.0, "dear": 10.5, "": 0.5})
    assert prices.of(spend) == pytest.approx(14.0)
    batch = Spend()
    batch.took(LLMResponse("{}", "m", 1000, 0, "stop", deployment="dear"), discounted=True)
    assert prices.of(batch) == pytest.approx(10.0 * settings.batch_api.price_ratio)
    # What a call may cost, before it is routed (a cap's hold): at the dearest price.
    assert prices.estimate(1000, 1000, Tier.SYNC) == pytest.approx(10.5)
    assert prices.estimate(1000, 1000, Tier.BATCH) == pytest.approx(10.5 * prices.discount)


def guarded(name: str, **limiter: Any) -> GuardedClient:
    return GuardedClient(FakeLLM(), limiter=RateLimiter(rpm=limiter.pop("rpm", 6000)),
                         breaker=CircuitBreaker(name, min_calls=1, open_s=60),
                         deployment=name)  # fmt: skip


async def test_the_route_leaves_a_deployment_whose_breaker_is_open_or_that_is_throttled() -> None:
    a, b = guarded("a"), guarded("b")
    route = Route("m", [Member("a", a), Member("b", b)], seed=1)
    picked = {route.pick().deployment for _ in range(200)}
    assert picked == {"a", "b"}  # both have room: spread
    admission = a.breaker.admit()
    assert admission is not None
    a.breaker.settle(admission, False)  # a's circuit opens
    assert {route.pick().deployment for _ in range(50)} == {"b"}
    b.limiter.throttled(30.0)  # b is told to wait 30 s: a still waits longer (open 60 s)
    assert route.pick().deployment == "b"
    c = guarded("c")
    route = Route("m", [Member("b", b), Member("c", c)], seed=1)
    assert {route.pick().deployment for _ in range(50)} == {"c"}  # b paused, c has room


async def test_a_prompt_prefix_goes_back_to_the_deployment_that_served_it() -> None:
    a, b = guarded("a"), guarded("b")
    route = Route("m", [Member("a", a), Member("b", b)], seed=3)
    system = [{"role": "system", "content": "Classify the comment. " * 200},
              {"role": "user", "content": "<comment>ok</comment>"}]  # fmt: skip
    prefix = prefix_of(system)  # long enough for a provider to cache it
    first = route.pick(Lane.LIVE, prefix).deployment
    assert {route.pick(Lane.LIVE, prefix).deployment for _ in range(50)} == {first}
    # A session's later turns share its first turn: the same deployment.
    turn = [*system, {"role": "assistant", "content": "{}"}, {"role": "user", "content": "x"}]
    assert prefix_of(turn) == prefix_of([*system, {"role": "assistant", "content": "{}"},
                                         {"role": "user", "content": "y"}, turn[-1]])  # fmt: skip
    # A short one is spread by weight, as any call.
    short = prefix_of([{"role": "system", "content": "Classify."}, system[1]])
    assert short is None
    assert {route.pick(Lane.LIVE, short).deployment for _ in range(50)} == {"a", "b"}
    # ... and a long one too when it costs a wait: paused, it goes where there is room.
    (a if first == "a" else b).limiter.throttled(5.0)
    assert route.pick(Lane.LIVE, prefix).deployment != first


async def test_calls_spread_over_deployments_move_off_a_failing_one_and_cost_its_price(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    east = await SimulatorServer(SimConfig(api_key="k-east", latency_ms=20)).start()
    west = await SimulatorServer(SimConfig(api_key="k-west", latency_ms=20,
                                           models=["mini-prod"])).start()  # fmt: skip
    broken = await SimulatorServer(SimConfig(error_500_rate=1.0)).start()
    monkeypatch.setenv("EAST_KEY", "k-east")
    (tmp_path / "west.key").write_text("k-west")
    path = write(tmp_path, [
        {"name": "east", "model": "sim-1", "base_url": east.base_url, "api_key_env": "EAST_KEY",
         "price_per_1k_prompt_usd": 1.0, "price_per_1k_completion_usd": 0.0},
        {"name": "west", "model": "sim-1", "auth": "azure",
         "base_url": west.base_url.removesuffix("/v1"), "provider_model": "mini-prod",
         "api_version": "2024-10-21", "api_key_file": str(tmp_path / "west.key"),
         "price_per_1k_prompt_usd": 3.0, "price_per_1k_completion_usd": 0.0},
        {"name": "broken", "model": "sim-1", "base_url": broken.base_url},
    ])  # fmt: skip
    settings = load_settings(
        llm={"base_url": "http://127.0.0.1:1/v1", "model": "sim-1", "deployments_file": path,
             "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        resilience={"breaker_min_calls": 3, "breaker_open_s": 1.0},
    )  # fmt: skip

    try:
        async with Analyzer(settings) as analyzer:
            metrics = analyzer.metrics
            outcomes = []
            for wave in range(6):  # spread while all have room: the failing one is tried
                outcomes += await asyncio.gather(
                    *(analyzer.analyze(t) for t in tasks(10 * wave, 10))
                )
            state_then = metrics.breaker_state.labels("broken")._value.get()
            failed = broken.sim.by_status[500]
            broken.sim.config.error_500_rate = 0.0  # it heals
            await asyncio.sleep(1.2)  # its circuit half-opens
            for wave in range(6, 12):  # traffic comes back once its probes pass
                outcomes += await asyncio.gather(
                    *(analyzer.analyze(t) for t in tasks(10 * wave, 10))
                )
    finally:
        for server in (east, west, broken):
            await server.stop()
    assert [o.kind for o in outcomes] == ["result"] * 120  # every task answered, none lost
    assert state_then == 2  # the failing deployment's circuit was open ...
    assert 3 <= failed < 60  # ... once it had been tried: then it was left
    served = {s: server.sim.by_status[200] for s, server in
              (("east", east), ("west", west), ("broken", broken))}  # fmt: skip
    assert served["east"] > 0 and served["west"] > 0  # the Azure-style one too (api-key)
    assert served["broken"] > 3  # back: more than its probes
    assert sum(served.values()) == 120
    assert west.sim.by_status[401] == 0 and east.sim.by_status[401] == 0
    assert metrics.breaker_state.labels("broken")._value.get() == 0  # closed again
    # Each deployment's tokens at its own price; the results' cost is their sum.
    cost = {d: metrics.deployment_cost.labels(d)._value.get() for d in ("east", "west")}
    assert cost["east"] == pytest.approx(east.sim.prompt_tokens * 1.0 / 1000)
    assert cost["west"] == pytest.approx(west.sim.prompt_tokens * 3.0 / 1000)
    default_price = settings.llm.price_per_1k_prompt_usd, settings.llm.price_per_1k_completion_usd
    assert metrics.deployment_cost.labels("broken")._value.get() == pytest.approx(
        (broken.sim.prompt_tokens * default_price[0] + broken.sim.completion_tokens
         * default_price[1]) / 1000)  # fmt: skip
    total = sum(o.record()["cost_usd"] for o in outcomes)
    assert total == pytest.approx(sum(metrics.deployment_cost.labels(d)._value.get()
                                      for d in ("east", "west", "broken")))  # fmt: skip
    for outcome in outcomes:  # each result says what each deployment cost it
        record = outcome.record()
        assert set(record["cost_by_deployment"]) <= {"east", "west", "broken"}
        assert sum(record["cost_by_deployment"].values()) == pytest.approx(record["cost_usd"])
    assert metrics.deployment_calls.labels("broken", "error")._value.get() == failed
    # The operator's view: each deployment's breaker, calls and spend.
    snap = StatusView(metrics).snapshot()
    shown = {d["deployment"]: d for d in snap["deployments"]}
    assert set(shown) == {"east", "west", "broken"}
    assert (shown["broken"]["errors"], shown["broken"]["breaker"]) == (failed, "closed")
    assert shown["east"]["ok"] == served["east"]
    assert shown["west"]["cost_usd"] == pytest.approx(cost["west"])
    page = render_html(snap)
    assert "<h2>Deployments " in page and ">broken</td>" in page


async def test_a_deployment_that_does_not_serve_its_model_is_left_for_the_others(
    tmp_path: Path,
) -> None:
    """A deployment answering 404 for its model (its provider_model mistyped, the model
    retired) is failing, not the task: its calls go on to the model's other deployment
    and its circuit opens; every task is answered. On the default endpoint, which serves
    other models too, the same 404 opens the model's own circuit: the tasks end as
    circuit_open at their deadline (redrivable) once it has been asked a few times, not
    each as a bad request; the endpoint's breaker is not judged by one model."""
    good = await SimulatorServer(SimConfig(latency_ms=5)).start()
    typo = await SimulatorServer(SimConfig(latency_ms=5, models_only=True)).start()
    path = write(tmp_path, [
        {"name": "good", "model": "sim-1", "base_url": good.base_url},
        {"name": "typo", "model": "sim-1", "base_url": typo.base_url, "provider_model": "sim-l"},
    ])  # fmt: skip
    tuning = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}
    breaker = {"breaker_min_calls": 3, "breaker_open_s": 60.0}
    deployed = load_settings(llm={"base_url": "http://127.0.0.1:1/v1", "model": "sim-1",
                                  "deployments_file": path, **tuning}, resilience=breaker)  # fmt: skip
    alone = load_settings(llm={"base_url": typo.base_url, "model": "sim-2", **tuning,
                               "task_deadline_s": 5.0}, resilience=breaker)  # fmt: skip

    try:
        async with Analyzer(deployed) as analyzer:
            outcomes: list[Outcome] = []
            for wave in range(4):
                outcomes += await asyncio.gather(
                    *(analyzer.analyze(t) for t in tasks(10 * wave, 10))
                )
            state = analyzer.metrics.breaker_state.labels("typo")._value.get()
        refused = typo.sim.by_status[404]
        async with Analyzer(alone) as analyzer:
            letters = [await analyzer.analyze(t) for t in tasks(100, 6)]
            breakers = breaker_states(analyzer)
    finally:
        for server in (good, typo):
            await server.stop()
    assert [o.kind for o in outcomes] == ["result"] * 40  # none dead-lettered by the 404s
    assert 1 <= refused <= 10 and state == 2  # the deployment tried, then left: open
    assert good.sim.by_status[200] == 40
    assert typo.sim.by_status[200] == 0
    errors = [letter.record()["error"] for letter in letters]
    assert [(e["category"], e["code"]) for e in errors] == [("circuit_open", "circuit_open")] * 6
    assert "model sim-2 is open" in errors[-1]["message"]
    assert typo.sim.by_status[404] - refused == 3  # the breaker's few calls, then none
    assert breakers == {f"{typo.base_url}/": 0, f"{typo.base_url}/ model sim-2": 2}


async def test_tasks_for_a_model_the_endpoint_does_not_serve_yet_wait_for_it() -> None:
    """A model not pulled into the local server yet (Ollama's 404): the tasks wait for
    it within their deadlines instead of each ending as a bad request; pulled, every one
    is answered, once, and the model's circuit closes."""
    server = await SimulatorServer(SimConfig(latency_ms=5, models_only=True)).start()
    settings = load_settings(
        llm={"base_url": server.base_url, "model": "sim-2", "backoff_base_s": 0.01,
             "backoff_max_s": 0.05, "task_deadline_s": 30.0},
        resilience={"breaker_min_calls": 3, "breaker_open_s": 0.3, "breaker_probes": 1},
    )  # fmt: skip
    name = f"{server.base_url}/ model sim-2"
    try:
        async with Analyzer(settings) as analyzer:
            waiting = [asyncio.ensure_future(analyzer.analyze(t)) for t in tasks(0, 8)]
            for _ in range(1000):  # 10 s at most
                if breaker_states(analyzer).get(name) == 2:
                    break
                await asyncio.sleep(0.01)
            assert breaker_states(analyzer).get(name) == 2  # the model's circuit opened
            await asyncio.sleep(0.5)  # open, half-open, refused again: still waiting
            assert not any(w.done() for w in waiting)
            server.sim.config.models_only = False  # pulled
            outcomes = await asyncio.gather(*waiting)
            closed = breaker_states(analyzer)[name]
    finally:
        await server.stop()
    assert [o.kind for o in outcomes] == ["result"] * 8
    assert server.sim.by_status[200] == 8 and closed == 0
    # A few to open it, then a probe a round (without the circuit: up to 4 attempts each).
    assert 3 <= server.sim.by_status[404] < 20


def test_the_shipped_example_is_a_valid_deployments_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_KEY_A", "a")
    monkeypatch.setenv("OPENAI_KEY_B", "b")
    example = (ROOT / "examples" / "deployments.yaml").read_text()
    (tmp_path / "azure.key").write_text("c")
    path = tmp_path / "deployments.yaml"
    path.write_text(example.replace("/run/secrets/azure-westeurope", str(tmp_path / "azure.key")))
    found = load_deployments(path)
    assert [d.name for d in found] == ["openai-a", "openai-b", "azure-westeurope"]
    assert found[2].azure is not None and found[2].spec.weight == 0.5


async def test_a_deployment_whose_calls_fail_in_a_row_is_cooled_off_before_its_window_judges() -> (
    None
):
    a, b = guarded("a"), guarded("b")
    a.breaker.min_calls = 1000  # its window would take long to judge
    route = Route("m", [Member("a", a), Member("b", b)], seed=2)
    for _ in range(3):
        admission = a.breaker.admit()
        assert admission is not None
        a.breaker.settle(admission, False)
    assert a.breaker.state.value == "closed" and a.breaker.cooling_for() > 0.4
    assert {route.pick().deployment for _ in range(50)} == {"b"}
    admission = a.breaker.admit()
    assert admission is not None  # cooling refuses nothing: it is the router's choice
    a.breaker.settle(admission, True)  # one answer: warm again
    assert a.breaker.cooling_for() == 0.0
    assert {route.pick().deployment for _ in range(100)} == {"a", "b"}


async def test_pipelines_validate_endpoint_reports_each_deployment_of_a_model(
    tmp_path: Path, shipped_pipelines: Any
) -> None:
    from streams.ops.endpoint import endpoint_report

    east = await SimulatorServer(SimConfig(api_key="k-east")).start()
    azure = await SimulatorServer(SimConfig(api_key="k-azure", models=["mini-prod"])).start()
    (tmp_path / "east.key").write_text("k-east")
    (tmp_path / "azure.key").write_text("k-azure")
    path = write(tmp_path, [
        {"name": "east", "model": "gpt-4o-mini", "base_url": east.base_url,
         "api_key_file": str(tmp_path / "east.key")},
        {"name": "azure", "model": "gpt-4o-mini", "auth": "azure",
         "base_url": azure.base_url.removesuffix("/v1"), "provider_model": "mini-prod",
         "api_version": "2024-10-21", "api_key_file": str(tmp_path / "azure.key")},
    ])  # fmt: skip
    settings = load_settings(llm={"base_url": east.base_url, "api_key": "k-east",
                                  "model": "gpt-4o-mini", "deployments_file": path})  # fmt: skip
    try:
        lines = await endpoint_report(settings, shipped_pipelines)
    finally:
        await east.stop()
        await azure.stop()
    said = "\n".join(lines)
    assert f"deployment east endpoint {east.base_url}" in said
    assert "deployment azure endpoint" in said and "/openai/deployments/mini-prod" in said
    assert "refused" not in said  # both honoured json_schema with their own keys
    assert azure.sim.by_status[200] >= 3 and azure.sim.by_status[401] == 0


async def one_by_one(
    settings: Settings, n: int, deployment: str, *servers: SimulatorServer
) -> tuple[list[Outcome], float]:
    """`n` comments answered one after the other, then the servers stopped; and what
    `deployment` cost meanwhile."""
    try:
        async with Analyzer(settings) as analyzer:
            outcomes = [await analyzer.analyze({"task_id": f"t-{i}", "pipeline":
                                                "comment-analysis", "input": {"text":
                                                f"Comment {i}: works fine."}})
                        for i in range(n)]  # fmt: skip
            return outcomes, analyzer.metrics.deployment_cost.labels(deployment)._value.get()
    finally:
        for server in servers:
            await server.stop()


async def test_a_deployment_at_its_spend_cap_leaves_its_calls_to_the_others(
    tmp_path: Path,
) -> None:
    """LiteLLM's per-deployment `max_budget`, here: a deployment's `usd_per_hour` counts
    what every task's calls to it cost; past it, the model's calls go to the others."""
    dear = await SimulatorServer(SimConfig(latency_ms=5)).start()
    cheap = await SimulatorServer(SimConfig(latency_ms=5)).start()
    path = write(tmp_path, [
        {"name": "dear", "model": "sim-1", "base_url": dear.base_url,
         "price_per_1k_prompt_usd": 1.0, "usd_per_hour": 0.05},
        {"name": "cheap", "model": "sim-1", "base_url": cheap.base_url},
    ])  # fmt: skip
    settings = load_settings(llm={"base_url": "http://127.0.0.1:1/v1", "model": "sim-1",
                                  "deployments_file": path})  # fmt: skip
    outcomes, spent = await one_by_one(settings, 30, "dear", dear, cheap)
    assert [o.kind for o in outcomes] == ["result"] * 30
    served = dear.sim.by_status[200]
    # A call costs more than the cap at this price: the first one to it is its last.
    assert served == 1 and spent >= 0.05
    assert cheap.sim.by_status[200] == 29


async def test_a_fallback_whose_deployments_are_at_their_caps_is_not_tried(
    tmp_path: Path,
) -> None:
    """A task is admitted under its primary model's caps only: a fallback model's
    deployments at theirs take no call (before, the route picked the soonest of them
    anyway and each failing task spent past the cap); the primary's failure stands."""
    down = await SimulatorServer(SimConfig(error_500_rate=1.0)).start()
    spare = await SimulatorServer(SimConfig(latency_ms=5, models=["backup-1"])).start()
    path = write(tmp_path, [
        {"name": "main", "model": "sim-1", "base_url": down.base_url},
        {"name": "spare", "model": "backup-1", "base_url": spare.base_url,
         "price_per_1k_prompt_usd": 1.0, "usd_per_hour": 0.05},
    ])  # fmt: skip
    text = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    fallback = "    response_format: json_schema\n    fallbacks:\n      - model: backup-1\n"
    assert "    response_format: json_schema\n" in text
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "c.yaml").write_text(
        text.replace("    response_format: json_schema\n", fallback)
    )
    settings = load_settings(
        llm={"base_url": "http://127.0.0.1:1/v1", "model": "sim-1", "deployments_file": path,
             "max_attempts": 2, "backoff_base_s": 0.001, "backoff_max_s": 0.001},
        pipelines_dir=tmp_path / "p", schemas_dir=ROOT / "schemas",
    )  # fmt: skip
    outcomes, spent = await one_by_one(settings, 4, "spare", down, spare)
    assert outcomes[0].kind == "result"  # the fallback answered: its call passed its cap
    assert outcomes[0].record()["model"] == "backup-1" and spent >= 0.05
    assert spare.sim.by_status[200] == 1  # then never again this hour
    for outcome in outcomes[1:]:
        record = outcome.record()
        assert outcome.kind == "dead_letter"
        assert record["error"]["category"] in ("upstream_error", "circuit_open")
