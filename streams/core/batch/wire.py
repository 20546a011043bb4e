"""The provider's side of the batch lane: its operations (`BatchOps`), a request as a line
of a batch file, an error line in the project's taxonomy, and what a batch's end means
for one request (`Answer`: an answer, an error, or send it again)."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from streams.core.batch.parking import Released
from streams.errors import TaskError, UpstreamError
from streams.llm.client import (
    LLMRequest,
    LLMResponse,
    error_for_status,
    parse_completion,
    request_body,
)

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


def answer_of(line: dict[str, Any]) -> Answer:
    """A batch file's line as the attempt's answer: its completion, or its error in the
    usual taxonomy (or: send again). Never raises: a line that is neither (no completion
    in a 200, a body or response of another shape) is its own request's upstream error,
    not the batch's — the other lines' answers, paid for, are handed out all the same."""
    response = _object(line.get("response"))
    if _status(response) != 200:
        return error_of(line)
    body = response.get("body")
    model = str(body.get("model") or "") if isinstance(body, dict) else ""
    try:
        return parse_completion(orjson.dumps(body), model)
    except TaskError as exc:
        return exc
    except orjson.JSONEncodeError as exc:  # a number past 64 bits: no completion's
        return UpstreamError(f"batch: a line that is no completion: {exc}",
                             code="malformed_response")  # fmt: skip


def error_of(line: dict[str, Any]) -> TaskError | Resubmit:
    """A batch error line in the usual taxonomy (or: send again)."""
    response = _object(line.get("response"))
    status = _status(response)
    body = response.get("body") or {}
    error = (body.get("error") if isinstance(body, dict) else None) or line.get("error") or {}
    if not isinstance(error, dict):  # a gateway's words for it
        error = {"message": str(error)[:1000]}
    message = str(error.get("message") or f"batch request failed with status {status}")
    code = str(error.get("code") or f"http_{status}")
    if not status:  # no response: the batch did not get to it
        return (
            RESUBMIT
            if code in ("batch_expired", "batch_cancelled")
            else UpstreamError(f"batch: {message}", code=code)
        )
    return error_for_status(status, code, f"batch: HTTP {status}: {message}", body=body)


def _object(said: Any) -> dict[str, Any]:
    """A line's part that should be an object, as one (another shape: an empty one)."""
    return said if isinstance(said, dict) else {}


def _status(response: dict[str, Any]) -> int:
    """A line's HTTP status; 0 when it says none a status can be."""
    said = response.get("status_code")
    if isinstance(said, bool) or not isinstance(said, int | float | str):
        return 0
    try:
        return int(said)
    except (ValueError, OverflowError):
        return 0


__all__ = [
    "RESUBMIT",
    "TERMINAL",
    "Answer",
    "BatchOps",
    "Resubmit",
    "answer_of",
    "error_of",
    "request_line",
]
