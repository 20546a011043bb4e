"""Record header names the project writes and reads (all `llm-streams-*`)."""

from __future__ import annotations

from typing import Any

REPLAY_ID_HEADER = "llm-streams-replay-id"  # the replay a record was sent by
REPLAY_OF_HEADER = "llm-streams-replay-of"  # topic/partition/offset it was copied from
FORCE_HEADER = "llm-streams-force"  # "1": ask the LLM again even when answered
TIER_HEADER = "llm-streams-tier"  # sync | flex | batch: how the worker answers the record
BACKTRACK_HEADER = "llm-streams-backtrack"  # restore | rerun: a backtrack of the task
REDRIVE_HEADER = "llm-streams-redrive-of"  # topic/partition/offset of the dead letter
REROUTED_FROM_HEADER = "llm-streams-rerouted-from"  # where a misrouted record came from
SOURCE_OF_HEADER = "llm-streams-source-of"  # topic/partition/offset a mapped task came from
RESULT_KEY_HEADER = "llm-streams-result-key"  # a sink record's answer, by its result key
TASK_ID_HEADER = "llm-streams-task-id"  # a sink record's task
# On a record of the task topics: not a task, a request to erase one (`EraseRequest`);
# its value says who asked: "source" (a delete upstream) or "command" (`llm-streams erase`).
ERASE_HEADER = "llm-streams-erase"


# A record's headers as read: a value may be None (a header without a value).
Headers = list[tuple[str, bytes | None]]


def header_items(headers: Any) -> Headers:
    """A record's headers as (name, value) pairs, whether a client gives a mapping or a
    sequence of pairs (Faust, aiokafka). A value may be None: Kafka allows a header
    without a value, and aiokafka gives it as None."""
    if not headers:
        return []
    if isinstance(headers, dict):
        return list(headers.items())
    return list(headers)  # a sequence of pairs
