"""Which dead letters a redrive sends again, without a broker."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from streams.contract.records import stored_time
from streams.ops.redrive import plan_redrive

SINCE = datetime(2026, 11, 29, 10, tzinfo=UTC)


def letter(task_id: str, failed_at: Any, category: str = "upstream_error") -> dict[str, Any]:
    return {"payload": {"task_id": task_id}, "error": {"category": category},
            "failed_at": failed_at, "source": {"topic": "llm-tasks", "partition": 0,
                                               "offset": int(task_id[1:])}}  # fmt: skip


def test_a_redrive_since_a_time_reads_every_stored_time_it_meets() -> None:
    letters = [
        letter("t1", "2026-11-29T09:00:00.000Z"),  # before
        letter("t2", "2026-11-29T11:00:00.000Z"),  # after
        letter("t3", "2026-11-29T11:00:00"),  # after, written without its zone (UTC)
        letter("t4", "2026-11-29T09:00:00"),  # before, the same
        letter("t5", 1764410400),  # no time: not known to be before
        letter("t6", "2026-11-29T11:00:00.000Z", category="bad_request"),  # not redrivable
    ]
    states = {f"t{n}": {"status": "dead_lettered", "source": letters[n - 1]["source"]}
              for n in range(1, 7)}  # fmt: skip
    plan = plan_redrive(letters, states, {"upstream_error", "bad_request"}, SINCE)
    # Once a TypeError: a time without its zone cannot be compared with --since's.
    assert [r["payload"]["task_id"] for r in plan.requeue] == ["t2", "t3", "t5"]
    assert (plan.skipped_before, plan.skipped_category) == (2, 1)


def test_stored_times_are_aware_or_none() -> None:
    assert stored_time("2026-11-29T10:00:00Z") == SINCE
    assert stored_time("2026-11-29T10:00:00") == SINCE
    assert stored_time("2026-11-29T11:00:00+01:00") == SINCE
    assert stored_time(None) is None and stored_time("garbled") is None
    assert stored_time(7) is None and stored_time({"at": 1}) is None
