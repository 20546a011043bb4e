"""The provider's side of the batch lane: its operations (`BatchOps`), a request as a line
of a batch file, an error line in the project's taxonomy, and what a batch's end means
for one request (`Answer`: an answer, an error, or send it again)."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from streams.core.batch.parking import Released
from streams.errors import TaskError, UpstreamError
from streams.llm.client import LLMRequest, LLMResponse, error_for_status, request_body

TERMINAL = {"completed", "expired", "cancelled", "failed"}


class BatchOps(Protocol):
    async def upload_batch_file(self, data: bytes, name: str) -> str: ...
    async def create_batch(
        self, input_file_id: str, metadata: dict[str, str]
    ) -> dict[str, Any]: ...
    async def retrieve_batch(self, batch_id: str) -> dict[str, Any]: ...
    async def list_batches(
        self, after: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]: ...
    async def file_content(self, file_id: str) -> bytes: ...


class Resubmit:
    """Batch `batch` gave no answer for the request (expired, cancelled, refused): send it
    again — unless the ledger already has it in a later batch (another run of the same
    record sent it again first)."""

    def __init__(self, batch: str | None = None) -> None:
        self.batch = batch


RESUBMIT = Resubmit()
Answer = LLMResponse | TaskError | Resubmit | Released


def request_line(custom_id: str, request: LLMRequest) -> bytes:
    body = request_body(request)
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return orjson.dumps(line) + b"\n"


def error_of(line: dict[str, Any]) -> TaskError | Resubmit:
    """A batch error line in the usual taxonomy (or: send again)."""
    response = line.get("response") or {}
    status = int(response.get("status_code") or 0)
    body = response.get("body") or {}
    error = (body.get("error") if isinstance(body, dict) else None) or line.get("error") or {}
    message = str(error.get("message") or f"batch request failed with status {status}")
    code = str(error.get("code") or f"http_{status}")
    if not status:  # no response: the batch did not get to it
        return (
            RESUBMIT
            if code in ("batch_expired", "batch_cancelled")
            else UpstreamError(f"batch: {message}", code=code)
        )
    return error_for_status(status, code, f"batch: HTTP {status}: {message}", body=body)


__all__ = ["RESUBMIT", "TERMINAL", "Answer", "BatchOps", "Resubmit", "error_of", "request_line"]
