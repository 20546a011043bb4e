"""The simulator's Files and Batch API, shaped like OpenAI's.

`POST /v1/files` (multipart: purpose, file), `GET /v1/files/{id}/content`,
`POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches` (newest first,
`limit`, `after`), `POST /v1/batches/{id}/cancel`.

A batch is `in_progress` from its creation and finishes `batch_delay_s` later,
when it is next retrieved: every request line is answered as the chat endpoint
would (no latency, no rate limit), into the output file; a share
`batch_item_error_rate` of them fail with a 500 into the error file. The next
`batch_expire_next` batches expire instead, after answering only
`batch_expire_fraction` of their lines (the rest go to the error file as
`batch_expired`). `batch_token_limit` caps the tokens enqueued in unfinished
batches: a batch over it fails with `token_limit_exceeded`. The next
`batch_create_lost_next` creations make their batch and answer 502 (the answer lost).

`submissions` counts, per custom_id, the batches it was sent in, and
`outcomes` how each of those ended for it (ok, error, expired), so tests can
prove that an item is sent again only after its earlier batch gave it no answer.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiohttp import web
from aiohttp.web_request import FileField

from streams.llm.tokens import count_messages


class Host(Protocol):
    """What the batch API uses of the simulator that serves it (no import of it: the
    simulator imports this module)."""

    app: web.Application
    config: Any
    by_outcome: Counter[str]
    rng: random.Random
    prompt_tokens: int
    completion_tokens: int

    def auth(self, request: web.Request) -> web.Response | None: ...

    def count_tokens(self, text: str) -> int: ...


def _invalid(status: int, message: str) -> web.Response:
    """An OpenAI-shaped invalid_request_error."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=status)


@dataclass
class _Batch:
    id: str
    input_file_id: str
    endpoint: str
    metadata: dict[str, Any]
    lines: list[dict[str, Any]]
    tokens: int
    created_at: float
    due_at: float
    expire: bool
    status: str = "in_progress"
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    finished_at: float | None = None
    counts: dict[str, int] = field(
        default_factory=lambda: {"total": 0, "completed": 0, "failed": 0}
    )

    def view(self) -> dict[str, Any]:
        created = int(self.created_at)
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": self.errors,
            "input_file_id": self.input_file_id,
            "completion_window": "24h",
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": created,
            "in_progress_at": created,
            "expires_at": created + 86_400,
            "completed_at": int(self.finished_at)
            if self.status == "completed" and self.finished_at
            else None,
            "expired_at": int(self.finished_at)
            if self.status == "expired" and self.finished_at
            else None,
            "failed_at": int(self.created_at) if self.status == "failed" else None,
            "cancelled_at": int(self.finished_at)
            if self.status == "cancelled" and self.finished_at
            else None,
            "request_counts": dict(self.counts),
            "metadata": self.metadata,
        }


class BatchAPI:
    """Files and batches kept in memory by one simulator."""

    def __init__(self, sim: Host, content: Callable[[dict[str, Any], list[Any]], str]) -> None:
        self.sim = sim
        self.content = content
        self.files: dict[str, tuple[str, bytes]] = {}  # id -> (purpose, bytes)
        self.batches: dict[str, _Batch] = {}
        self.order: list[str] = []  # creation order
        self.submissions: Counter[str] = Counter()
        self.outcomes: dict[str, list[str]] = {}
        app = sim.app
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files/{id}/content", self.download)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{id}", self.retrieve)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    def snapshot(self) -> dict[str, Any]:
        statuses = Counter(b.status for b in self.batches.values())
        return {
            "batches": len(self.batches),
            "batches_by_status": dict(statuses),
            "batch_items_submitted": sum(self.submissions.values()),
            "batch_items_distinct": len(self.submissions),
        }

    def _file(self, purpose: str, data: bytes) -> str:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.files[file_id] = (purpose, data)
        return file_id

    async def upload(self, request: web.Request) -> web.Response:
        if (denied := self.sim.auth(request)) is not None:
            return denied
        form = await request.post()
        upload = form.get("file")
        purpose = str(form.get("purpose") or "")
        if not isinstance(upload, FileField) or purpose != "batch":
            return _invalid(400, "need a file and purpose=batch")
        data = upload.file.read()
        file_id = self._file(purpose, data)
        return web.json_response(
            {
                "id": file_id,
                "object": "file",
                "bytes": len(data),
                "created_at": int(time.time()),
                "filename": upload.filename,
                "purpose": purpose,
                "status": "processed",
            }
        )

    async def download(self, request: web.Request) -> web.Response:
        if (denied := self.sim.auth(request)) is not None:
            return denied
        found = self.files.get(request.match_info["id"])
        if found is None:
            return _invalid(404, "No such file")
        return web.Response(body=found[1], content_type="application/octet-stream")

    async def create(self, request: web.Request) -> web.Response:
        if (denied := self.sim.auth(request)) is not None:
            return denied
        body = orjson.loads(await request.read())
        found = self.files.get(str(body.get("input_file_id")))
        if found is None:
            return _invalid(400, "input file not found")
        cfg = self.sim.config
        lines = [orjson.loads(line) for line in found[1].splitlines() if line.strip()]
        tokens = sum(
            count_messages(line["body"]["messages"]) + int(line["body"].get("max_tokens") or 256)
            for line in lines
        )
        now = time.time()
        expire = cfg.batch_expire_next > 0
        if expire:
            cfg.batch_expire_next -= 1
        batch = _Batch(
            id=f"batch_{uuid.uuid4().hex[:24]}",
            input_file_id=str(body["input_file_id"]),
            endpoint=str(body.get("endpoint")),
            metadata=dict(body.get("metadata") or {}),
            lines=lines,
            tokens=tokens,
            created_at=now,
            due_at=now + cfg.batch_delay_s,
            expire=expire,
        )
        batch.counts["total"] = len(lines)
        ids = [str(line.get("custom_id")) for line in lines]
        refused = self._refusal(ids, tokens)
        if refused is not None:
            batch.status, batch.errors = "failed", {"object": "list", "data": [refused]}
        else:
            for custom_id in ids:
                self.submissions[custom_id] += 1
        self.batches[batch.id] = batch
        self.order.append(batch.id)
        self.sim.by_outcome[f"batch_{batch.status}"] += 1
        if cfg.batch_create_lost_next > 0:  # made, and the answer lost on the way
            cfg.batch_create_lost_next -= 1
            return web.json_response({"error": {"message": "Bad gateway", "type": "server_error",
                                                "code": None}}, status=502)  # fmt: skip
        return web.json_response(batch.view())

    def _refusal(self, ids: list[str], tokens: int) -> dict[str, str] | None:
        """Why the provider fails a new batch at once (a custom_id twice, the enqueued-token
        limit passed), or None."""
        if len(set(ids)) != len(ids):
            return {"code": "duplicate_custom_id", "message": "custom_id values must be unique"}
        limit = self.sim.config.batch_token_limit
        enqueued = sum(
            b.tokens for b in self.batches.values() if b.status in ("in_progress", "finalizing")
        )
        if limit and enqueued + tokens > limit:
            why = f"Enqueued token limit reached: {enqueued} enqueued, limit {limit}."
            return {"code": "token_limit_exceeded", "message": why}
        return None

    async def _finish(self, batch: _Batch) -> None:
        """Answer the batch's lines (all, or the share an expiring batch gets to),
        letting the chat endpoint's requests in between (the provider answers batches
        on other machines)."""
        cfg = self.sim.config
        answered = len(batch.lines)
        if batch.expire:
            answered = int(len(batch.lines) * cfg.batch_expire_fraction)
        out, err = [], []
        for i, line in enumerate(batch.lines):
            if i % 10 == 9:
                await asyncio.sleep(0)
            custom_id = str(line.get("custom_id"))
            entry: dict[str, Any] = {
                "id": f"batch_req_{uuid.uuid4().hex[:20]}",
                "custom_id": custom_id,
                "response": None,
                "error": None,
            }
            if i >= answered:
                entry["error"] = {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the "
                    "completion window expired.",
                }
                err.append(entry)
                self.outcomes.setdefault(custom_id, []).append("expired")
                continue
            if self.sim.rng.random() < cfg.batch_item_error_rate:
                entry["response"] = {
                    "status_code": 500,
                    "request_id": uuid.uuid4().hex,
                    "body": {
                        "error": {
                            "message": "The server had an error.",
                            "type": "server_error",
                            "code": None,
                        }
                    },
                }
                err.append(entry)
                batch.counts["failed"] += 1
                self.outcomes.setdefault(custom_id, []).append("error")
                continue
            entry["response"] = self._answered(line["body"])
            out.append(entry)
            batch.counts["completed"] += 1
            self.outcomes.setdefault(custom_id, []).append("ok")
        batch.output_file_id = self._file(
            "batch_output", b"".join(orjson.dumps(e) + b"\n" for e in out)
        )
        if err:
            batch.error_file_id = self._file(
                "batch_output", b"".join(orjson.dumps(e) + b"\n" for e in err)
            )
        batch.status = "expired" if batch.expire else "completed"
        batch.finished_at = time.time()
        self.sim.by_outcome[f"batch_{batch.status}"] += 1

    def _answered(self, request: dict[str, Any]) -> dict[str, Any]:
        """A batch line's 200 answer: the completion the chat endpoint would give."""
        messages = request["messages"]
        text = self.content(request, messages)
        prompt_tokens = count_messages(messages)
        completion_tokens = self.sim.count_tokens(text)
        self.sim.prompt_tokens += prompt_tokens
        self.sim.completion_tokens += completion_tokens
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "stop"}  # fmt: skip
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        body = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": request.get("model"),
                "choices": [choice], "usage": usage}  # fmt: skip
        if self.sim.config.usage == "none":  # as its chat answers (`SimConfig.usage`)
            del body["usage"]
        elif self.sim.config.usage == "zeros":
            body["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}

    async def _advance(self, batch: _Batch) -> None:
        if batch.status == "in_progress" and time.time() >= batch.due_at:
            batch.status = "finalizing"  # one finisher; pollers meanwhile see it finalizing
            await self._finish(batch)

    async def retrieve(self, request: web.Request) -> web.Response:
        if (denied := self.sim.auth(request)) is not None:
            return denied
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            return _invalid(404, "No such batch")
        await self._advance(batch)
        return web.json_response(batch.view())

    async def list(self, request: web.Request) -> web.Response:
        if (denied := self.sim.auth(request)) is not None:
            return denied
        limit = int(request.query.get("limit", "20"))
        after = request.query.get("after")
        ids = list(reversed(self.order))
        if after in ids:
            ids = ids[ids.index(after) + 1 :]
        page = ids[:limit]
        data = []
        for batch_id in page:
            await self._advance(self.batches[batch_id])
            data.append(self.batches[batch_id].view())
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "has_more": len(ids) > limit,
                "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None,
            }
        )

    async def cancel(self, request: web.Request) -> web.Response:
        if (denied := self.sim.auth(request)) is not None:
            return denied
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            return _invalid(404, "No such batch")
        if batch.status == "in_progress":
            batch.status, batch.finished_at = "cancelled", time.time()
            for line in batch.lines:
                self.outcomes.setdefault(str(line.get("custom_id")), []).append("cancelled")
        return web.json_response(batch.view())
