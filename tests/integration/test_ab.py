"""A/B on real Kafka: two prompt versions on 2,000 tasks, one answered worse by the
simulator; `ab report` shows the difference with intervals and the label agreement on
tasks both answered; `ab promote` refuses the worse version and promotes the better."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.dev.simulator import SimulatorServer
from streams.kafka.topics import decisions_topic
from tests.integration.helpers import WorkerProcess, collect, produce, run_cli, topic_takes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORSE = "Answer as briefly as you can."  # only v2's system prompt says it


def two_versions(directory: Path) -> Path:
    """comment-analysis with v2 (v1 plus one sentence) and a 50/50 split."""
    src = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    v1 = yaml.safe_load(src)["versions"]["v1"]
    v2 = dict(v1, system=v1["system"] + WORSE + "\n")
    text = (
        src
        + "  v2:\n"
        + "\n".join("    " + line for line in yaml.safe_dump(v2, allow_unicode=True).splitlines())
    )
    text += "\n# Half and half while the versions are compared.\ntraffic:\n  v1: 0.5\n  v2: 0.5\n"
    directory.mkdir()
    path = directory / "comment-analysis.yaml"
    path.write_text(text)
    return path


async def test_report_and_promote_on_two_versions(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    path = two_versions(tmp_path / "pipelines")
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        pipelines_dir=path.parent, schemas_dir=ROOT / "schemas",
    )  # fmt: skip
    # v2's answers are cut off (invalid JSON) 30% of the time, its repairs too.
    simulator.sim.config.update({"malformed_if_prompt_has": {WORSE: 0.3}})
    moods = ["Great blender, I love it.", "Broke after a week, terrible.",
             "Arrived late but works fine.", "Okay for the price."]  # fmt: skip

    def task(task_id: str, i: int, version: str | None = None) -> tuple[bytes, bytes]:
        body: dict[str, Any] = {"task_id": task_id, "pipeline": "comment-analysis",
                                "input": {"text": f"{moods[i % 4]} Order {i}."}}  # fmt: skip
        if version:
            body["prompt_version"] = version
        return task_id.encode(), orjson.dumps(body)

    split = [task(f"ab-{i}", i) for i in range(2000)]
    # 100 tasks answered under both versions (pinned), for the label agreement.
    both = [task(f"both-{i}", i, v) for i in range(100) for v in ("v1", "v2")]
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, split + both)
        got = await collect(settings, set(offsets), timeout_s=300, worker=worker)
        metrics = await worker.scrape()
    finally:
        worker.stop()
    assert len(got.results) + len(got.dead_letters) == len(split) + len(both)
    # Dead letters name their version now.
    assert got.dead_letters and all(d["prompt_version"] == "v2" for d in got.dead_letters)
    passed_v1 = metrics.value("llm_streams_version_tasks_total", version="v1", verdict="pass")
    assert passed_v1 > 900

    done = run_cli(settings, "ab", "report", "--pipeline", "comment-analysis", "--json")
    assert done.returncode == 0, done.stderr
    data = orjson.loads(done.stdout)
    v1, v2 = data["versions"]
    assert (v1["version"], v2["version"]) == ("v1", "v2")
    assert v1["tasks"] + v2["tasks"] == 2000 + 200
    assert v1["pass_rate"] == 1.0 and 0.55 < v2["pass_rate"] < 0.85
    assert v2["repair_rate"] > 0.1
    (pair,) = data["pairs"]
    low, high = pair["pass_rate_difference"]["ci"]
    assert 0 < low < pair["pass_rate_difference"]["value"] < high
    agree = {g["label"]: g for g in pair["agreement"]}
    # Counted here from the results read off the topic: the tasks both versions answered.
    labels: dict[str, dict[str, str]] = {}
    for r in got.results:
        if r["task_id"].startswith("both-"):
            labels.setdefault(r["task_id"], {})[r["prompt_version"]] = r["output"]["sentiment"]
    pairs = [v for v in labels.values() if len(v) == 2]
    same = sum(v["v1"] == v["v2"] for v in pairs)
    assert len(pairs) >= 80
    assert (agree["sentiment"]["compared"], agree["sentiment"]["same"]) == (len(pairs), same)
    assert agree["sentiment"]["ci"][0] <= same / len(pairs) <= agree["sentiment"]["ci"][1]
    readable = run_cli(settings, "ab", "report", "--pipeline", "comment-analysis")
    assert "v1 better" in readable.stdout, readable.stdout

    before = path.read_text()
    refused = run_cli(settings, "ab", "promote", "--pipeline", "comment-analysis",
                      "--version", "v2", "--reason", "shorter prompt")  # fmt: skip
    assert refused.returncode == 1 and "significantly worse than v1" in refused.stderr
    assert path.read_text() == before
    # The decision cannot be recorded (the decisions topic refuses records that large): no
    # split changes without its record, and the command says why in one line.
    await topic_takes(settings, decisions_topic(settings), 64)
    unrecorded = run_cli(settings, "ab", "promote", "--pipeline", "comment-analysis",
                         "--version", "v1", "--reason", "v2 breaks its JSON")  # fmt: skip
    assert unrecorded.returncode == 1, unrecorded.stderr
    assert "Kafka refused it: MessageSizeTooLargeError" in unrecorded.stderr, unrecorded.stderr
    assert "Traceback" not in unrecorded.stderr
    assert path.read_text() == before
    await topic_takes(settings, decisions_topic(settings), 1_048_588)
    promoted = run_cli(settings, "ab", "promote", "--pipeline", "comment-analysis", "--version",
                       "v1", "--reason", "v2 breaks its JSON", "--by", "ab-test")  # fmt: skip
    assert promoted.returncode == 0, promoted.stderr
    spec = yaml.safe_load(path.read_text())
    assert spec["traffic"] == {"v1": 1.0} and spec["default_version"] == "v1"
    assert "# Half and half while the versions are compared." in path.read_text()
    log = run_cli(settings, "ab", "log", "--pipeline", "comment-analysis")
    assert log.returncode == 0, log.stderr
    (line,) = log.stdout.splitlines()
    assert "comment-analysis: v1 -> v1 1 by ab-test: v2 breaks its JSON" in line

    # v1 "improved" in place after its test: the figures are the old v1's, so a promotion
    # of the file's v1 is refused (what the edit does has not been measured), and said.
    spec["versions"]["v1"]["system"] += "Answer tersely.\n"
    path.write_text(yaml.safe_dump(spec))
    edited = run_cli(settings, "ab", "promote", "--pipeline", "comment-analysis", "--version",
                     "v1", "--reason", "again", "--share", "0.9")  # fmt: skip
    assert edited.returncode == 1, edited.stderr
    assert "another definition than the file's now" in edited.stderr, edited.stderr
    said = run_cli(settings, "ab", "report", "--pipeline", "comment-analysis")
    assert "made under an earlier definition" in said.stdout, said.stdout
