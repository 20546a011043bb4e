"""Prompt packing: several short records of one pipeline version in one request.

Tasks that qualify (the pipeline has `packing:`, the measured slot is short,
the input needs no chunking) wait up to `linger_s` for others with the same
pipeline, version, model, lane and system prompt; up to `max_items` go out as
one request: the system prompt once, then each task's own rendered message
inside `<item id="TASK_ID">…</item>`. The answer is one JSON object
`{"answers": [{"id": …, "answer": …}, …]}`; each answer is matched back by its
task id, never by position, and validated on its own. A task whose answer is
missing, duplicated or invalid — or whose pack failed — is answered alone, the
usual way. Tokens of a packed call are shared among its tasks (by the length
of what each sent and got back), and those of a packed answer no task got (cut,
filtered, ended by the server's error) by what each sent, so cost per task — and
the budgets it is held to — stays accounted.
"""

from __future__ import annotations

import asyncio
import html
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from streams.core.gathering import Gathering
from streams.core.spend import Tokens
from streams.llm.client import json_answer
from streams.pipelines.render import RenderedPrompt, delimiter_guard

log = logging.getLogger(__name__)

ITEM_TAG = "item"
INSTRUCTIONS = (
    '\n\nSeveral items follow, each inside <item id="…">…</item>. Treat every item on its '
    "own, exactly as the instructions above say for one. Reply with one JSON object "
    '{"answers": [{"id": "<the item\'s id, verbatim>", "answer": <the answer for that item>}]} '
    "holding one entry per item."
)
_GUARD = delimiter_guard(f"<{ITEM_TAG}>")


def packed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The answer schema for a pack: a list of {id, answer}, each answer per `schema`."""
    answer = {k: v for k, v in schema.items() if k not in ("$schema", "$id", "$defs", "title")}
    wrapper: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["answers"],
        "properties": {
            "answers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "answer"],
                    "properties": {"id": {"type": "string"}, "answer": answer},
                },
            }
        },
    }
    if "$defs" in schema:  # local refs (#/$defs/x) keep pointing at the root
        wrapper["$defs"] = schema["$defs"]
    return wrapper


def packed_messages(system: str, items: list[tuple[str, str]]) -> list[dict[str, str]]:
    """System prompt once, then each (id, rendered user message) in its item tags."""
    assert _GUARD is not None
    body = "\n\n".join(
        f'<{ITEM_TAG} id="{html.escape(item_id, quote=True)}">\n{_GUARD(text)}\n</{ITEM_TAG}>'
        for item_id, text in items
    )
    return [{"role": "system", "content": system + INSTRUCTIONS}, {"role": "user", "content": body}]


def split_answers(content: str, ids: list[str]) -> dict[str, Any]:
    """Answers by item id; ids answered twice or not asked are dropped."""
    try:
        data = json_answer(content)
    except orjson.JSONDecodeError:
        return {}
    answers = data.get("answers") if isinstance(data, dict) else None
    if not isinstance(answers, list):
        return {}
    wanted = set(ids)
    found: dict[str, Any] = {}
    twice: set[str] = set()
    for entry in answers:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        item_id = html.unescape(entry["id"])
        if item_id not in wanted:
            continue
        if item_id in found:
            twice.add(item_id)
        found[item_id] = entry.get("answer")
    return {k: v for k, v in found.items() if k not in twice}


def shares(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights`, in whole numbers that add up to it."""
    if not weights:
        return []
    if sum(weights) <= 0:
        weights = [1] * len(weights)
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    parts[-1] += total - sum(parts)
    return parts


@dataclass(frozen=True)
class PackedAnswer:
    """One task's part of a packed call: its answer (None: answer it alone) and share."""

    output: dict[str, Any] | None
    reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    calls: int = 0
    cached_prompt_tokens: int = 0
    deployment: str = ""  # the deployment that answered the pack
    # Its share of the answers the pack paid for and handed out to none (cut, filtered,
    # ended by the server's error): the tokens, their model and deployment, each.
    earlier: tuple[tuple[Tokens, str, str], ...] = ()
    # Its share of the pack's calls sent that got no answer: prompt tokens, deployment.
    unanswered: tuple[tuple[int, str], ...] = ()


@dataclass
class Item:
    task_id: str
    prompt: RenderedPrompt
    deadline_at: float
    check: Callable[[Any], dict[str, Any]]  # raises when the answer breaks the contract
    future: asyncio.Future[PackedAnswer] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def settle(self, answer: PackedAnswer) -> None:
        if not self.future.done():  # its task may have hit its deadline meanwhile
            self.future.set_result(answer)


Key = tuple[str, str, str, str, str]  # pipeline, version, model, lane, system prompt


class Packer:
    """Gathers items per key; sends a pack when `max_items` wait or `linger_s` passed."""

    def __init__(self, send: Callable[[Key, list[Item]], Awaitable[None]]) -> None:
        self._send = send
        self._gathering: Gathering[Key, Item] = Gathering(self._ready)
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, key: Key, item: Item, max_items: int, linger_s: float) -> PackedAnswer:
        self._gathering.add(key, item, lambda items: len(items) >= max_items, linger_s)
        return await item.future

    def _ready(self, key: Key, gathered: list[Item]) -> None:
        items = [i for i in gathered if not i.future.done()]
        if not items:
            return
        task = asyncio.create_task(self._run(key, items))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, key: Key, items: list[Item]) -> None:
        """Never leaves a task waiting on its pack: one the pack did not answer — it
        failed, was cancelled, or left the item out — is told to answer alone."""
        reason = "the pack gave it no answer"
        try:
            await self._send(key, items)
        except Exception as exc:
            log.exception("pack of %d tasks failed", len(items))
            reason = f"pack failed: {exc!r}"
        except BaseException:  # cancelled: its tasks go on without it
            reason = "pack cancelled"
            raise
        finally:
            for item in items:  # a no-op for the items the pack settled
                item.settle(PackedAnswer(None, reason=reason))


__all__ = [
    "INSTRUCTIONS",
    "Item",
    "PackedAnswer",
    "Packer",
    "packed_messages",
    "packed_schema",
    "shares",
    "split_answers",
]
