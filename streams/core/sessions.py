"""Session context: the earlier turns of a conversation, injected into a turn's prompt.

A pipeline version with `session:` keeps, per session, the turns answered so far (the
user's kept slots and the answer's kept fields; `Turns`, stored by the worker in the
task store's sessions map on the session's partition). A turn's prompt gets the turns
*before* it (by position: the record's offset on the session's partition, the original
one for a replayed record; for a task the session holds already, its turn's position)
as earlier user / assistant messages, trimmed to the version's token budget by
priority: the last turn first, then the turns marked as carrying intent or filled
slots (`mark` fields non-empty in their answer), then the rest newest first — so the
oldest unmarked turns go first — in the order they happened.

The context chosen is digested into the task's result and content keys (`context_of`),
so an answer given with another history is another answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from streams.pipelines.specs import SessionSpec

Message = dict[str, str]


@dataclass(frozen=True)
class Context:
    """The earlier turns a prompt carries, and their digest."""

    messages: list[Message]
    digest: str | None  # None: no earlier turn (the key is the one without sessions)
    turns: int


NONE = Context([], None, 0)


def _filled(value: Any) -> bool:
    return value not in (None, "", [], {})


def turn_of(
    task_id: str, position: int, variables: dict[str, Any], output: dict[str, Any],
    spec: SessionSpec,
) -> dict[str, Any]:  # fmt: skip
    """What a session keeps of one answered turn."""
    slots = spec.keep.slots
    fields = spec.keep.fields
    kept_in = {k: v for k, v in variables.items() if (slots is None or k in slots) and _filled(v)}
    kept_out = {k: v for k, v in output.items() if not fields or k in fields}
    marked = any(_filled(output.get(name)) for name in spec.mark)
    return {"task_id": task_id, "position": position, "input": kept_in, "output": kept_out,
            "marked": marked}  # fmt: skip


def add_turn(
    stored: bytes | None, turn: dict[str, Any], spec: SessionSpec, max_bytes: int = 1_000_000
) -> bytes:
    """The session's turns with `turn` in (replacing an earlier answer of its task), in
    order of position, the oldest beyond `spec.max_turns` dropped, and the oldest beyond
    what its topic takes (`max_bytes` bytes): a session never makes a write the broker refuses
    (with no turn that fits, it holds none)."""
    turns = [t for t in _turns(stored) if t.get("task_id") != turn["task_id"]]
    turns.append(turn)
    turns.sort(key=_position)
    turns = turns[-spec.max_turns :]
    value = orjson.dumps({"turns": turns})
    while len(value) > max_bytes and turns:
        turns = turns[1:]
        value = orjson.dumps({"turns": turns})
    return value


def without_turn(stored: bytes | None, task_id: str) -> bytes | None:
    """The session's turns without the task's (its input was deleted upstream): None when
    none is left (the session's entry goes), `stored` itself when it held no such turn."""
    turns = _turns(stored)
    kept = [t for t in turns if t.get("task_id") != task_id]
    if len(kept) == len(turns):
        return stored
    return orjson.dumps({"turns": kept}) if kept else None


def has_turn(stored: bytes | None, task_id: str) -> bool:
    return turn_position(stored, task_id) is not None


def turn_position(stored: bytes | None, task_id: str) -> int | None:
    """Where the task's turn stands in its session, if the session holds it. A task run
    again — a duplicate of the record arriving after later turns, a restart, a replay —
    takes its context from there: the turns before it when it was first answered, so
    it gets the same prompt and result key (the stored answer, no second call), and its
    turn keeps its place."""
    for t in _turns(stored):
        if t.get("task_id") == task_id:
            return _position(t)
    return None


def _position(turn: dict[str, Any]) -> int:
    """A turn's place in its session; 0 (first) for a position this version cannot read
    (another version's turn, a hand edit): its session goes on, not a bug per turn."""
    try:
        return int(turn.get("position", 0))
    except (TypeError, ValueError, OverflowError):
        return 0


def _turns(stored: bytes | None) -> list[dict[str, Any]]:
    if stored is None:
        return []
    try:
        data = orjson.loads(stored)
    except orjson.JSONDecodeError:
        return []
    turns = data.get("turns") if isinstance(data, dict) else None
    return [t for t in turns or [] if isinstance(t, dict) and "task_id" in t]


def messages_of(turn: dict[str, Any]) -> list[Message]:
    """A turn as the user message it was and the answer it got."""
    kept = turn.get("input") or {}
    if not isinstance(kept, dict):  # another version's turn: what it holds, as it is
        kept = {"input": kept}
    if len(kept) == 1:
        said = str(next(iter(kept.values())))
    else:
        said = "\n".join(f"{k}: {v}" for k, v in kept.items())
    answer = orjson.dumps(turn.get("output") or {}, option=orjson.OPT_SORT_KEYS).decode()
    return [{"role": "user", "content": said}, {"role": "assistant", "content": answer}]


def context_of(
    stored: bytes | None,
    task_id: str,
    position: int,
    spec: SessionSpec,
    count: Callable[[list[Message]], int],
) -> Context:
    """The earlier turns (before `position`, other tasks) within `spec.budget_tokens`."""
    earlier = [t for t in _turns(stored)
               if _position(t) < position and t.get("task_id") != task_id]  # fmt: skip
    if not earlier:
        return NONE
    newest_first = list(reversed(earlier))
    order = newest_first[:1]
    order += [t for t in newest_first[1:] if t.get("marked")]
    order += [t for t in newest_first[1:] if not t.get("marked")]
    chosen, used = [], 0
    for turn in order:
        cost = count(messages_of(turn))
        if used + cost <= spec.budget_tokens:
            chosen.append(turn)
            used += cost
    if not chosen:
        return NONE
    chosen.sort(key=_position)
    messages = [m for t in chosen for m in messages_of(t)]
    digest = hashlib.sha256(orjson.dumps(messages)).hexdigest()[:32]
    return Context(messages, digest, len(chosen))


def with_context(messages: list[Message], context: Context) -> list[Message]:
    """The prompt's messages with the earlier turns after the system message."""
    if not context.messages:
        return messages
    head = [m for m in messages[:1] if m.get("role") == "system"]
    return head + context.messages + messages[len(head) :]


__all__ = [
    "NONE", "Context", "add_turn", "context_of", "has_turn", "messages_of", "turn_of",
    "turn_position", "with_context",
]  # fmt: skip
