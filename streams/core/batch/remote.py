"""The batch lane's side of the provider: a batch created once (asking before each retry
whether an earlier try made it), found by the id in its metadata, polled to its end, and
its files read — each asked again while the provider fails, on the lane's `Clock`."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from streams.core.batch.files import BatchFiles, BatchLines
from streams.core.batch.ledger import BatchRecord
from streams.core.batch.wire import RESUBMIT, TERMINAL, Answer, BatchOps
from streams.errors import BadRequest, Permanent, RateLimited, Transient, UpstreamError
from streams.resilience.clock import Clock
from streams.resilience.retry import retry_transient
from streams.settings import BatchApiSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

METADATA_KEY = "llm_streams_batch"
# A batch recorded as being created is taken for never created only this long after:
# its creator may be between the ledger write and the provider's answer.
CREATE_GRACE_S = 120.0


class MaybeCreated(Exception):  # a state, not an error of ours
    """A create whose answer was lost, and the provider does not list the batch: it may
    exist all the same."""


def failure_of(batch: BatchRecord, others: int) -> Answer:
    """What a failed batch means for its requests. Over the enqueued-token limit: sent
    again once earlier batches are done (`others`: tokens of this worker's other
    batches) — unless none were running, then the batch alone is too big."""
    code = batch.error_code or "batch_failed"
    if code == "token_limit_exceeded" and others > 0:
        return RESUBMIT
    if code == "token_limit_exceeded":
        return BadRequest(
            f"batch {batch.remote_id} alone is over the provider's enqueued-token "
            "limit: lower LLM_STREAMS_BATCH_API__MAX_ITEMS or set "
            "__MAX_ENQUEUED_TOKENS to the limit",
            code="token_limit_exceeded",
        )
    return UpstreamError(f"batch {batch.remote_id} failed: {code}", code="batch_failed")


class RemoteBatches:
    """The provider's batches as the lane uses them."""

    def __init__(
        self,
        ops: BatchOps,
        settings: BatchApiSettings,
        clock: Clock,
        spawn: Callable[[Any], Any],
    ) -> None:
        self.ops = ops
        self.settings = settings
        self.clock = clock
        # Finished batches' files, read once and kept within a byte budget.
        self.files = BatchFiles(ops.file_content, settings.files_cache_bytes, spawn)

    async def create(self, batch: BatchRecord) -> dict[str, Any]:
        """Upload the file once and create the batch, retrying transient errors a few
        times — asking the provider first, before each retry, whether an earlier try made
        the batch (it carries our id in its metadata): a 5xx, a timeout or a dropped
        connection after the provider created it must not make it pay for a second one.
        Raises `MaybeCreated` when a create may have succeeded unseen and the provider
        does not list it; any other failure means it was not created."""
        data = b"".join(w.line for w in batch.lines)
        file_id: str | None = None
        unknown = False  # a create whose answer was lost: the batch may exist

        async def create() -> dict[str, Any]:
            nonlocal file_id, unknown
            if unknown:
                found = await self.find(batch.local_id, batch.created_at)
                if found is not None:
                    log.info("batch %s: created by an earlier try (%s)", batch.local_id,
                             found.get("id"))  # fmt: skip
                    return found
            if file_id is None:
                file_id = await self.ops.upload_batch_file(data, f"{batch.local_id}.jsonl")
            try:
                return await self.ops.create_batch(file_id, {METADATA_KEY: batch.local_id})
            except Exception as exc:
                # A refusal (4xx, 429) made nothing; anything else may have.
                unknown = unknown or not isinstance(exc, RateLimited | Permanent)
                raise

        try:
            return await retry_transient(
                create, what=f"creating batch {batch.local_id}",
                transient=lambda exc: isinstance(exc, Transient),
                attempts=5, first_s=1.0, max_s=16.0, sleep=self.clock.sleep,
            )  # fmt: skip
        except Exception as exc:
            if unknown:
                raise MaybeCreated() from exc
            raise

    async def find(self, local_id: str, created_at: float) -> dict[str, Any] | None:
        """The provider's batch carrying our id in its metadata, if it was created (asked
        again while the provider fails: a batch that may exist is never taken for one
        that does not)."""
        return await self.patiently(lambda: self._find_once(local_id, created_at),
                                    f"looking for batch {local_id}")  # fmt: skip

    async def found(
        self, batch: BatchRecord, latest: Callable[[BatchRecord], BatchRecord]
    ) -> tuple[BatchRecord, dict[str, Any] | None]:
        """A batch the ledger has as being created, and the provider's batch of it (None:
        none). Its creator may still be creating it (a worker that lost the partition a
        moment ago): up to `CREATE_GRACE_S` after its creation, the provider or the ledger
        (`latest`) is asked again until one says more."""
        found = await self.find(batch.local_id, batch.created_at)
        while found is None and time.time() - batch.created_at < CREATE_GRACE_S:
            await self.clock.sleep(self.settings.poll_s)
            now = latest(batch)
            if now.state != "creating":
                return now, None
            found = await self.find(batch.local_id, batch.created_at)
        return batch, found

    async def ended(self, batch: BatchRecord) -> None:
        """A submitted batch followed to its end: `batch` then holds its status, files
        and (failed) its error code."""
        assert batch.remote_id is not None
        remote = await self.poll(batch.remote_id)
        batch.state, batch.status = "done", str(remote["status"])
        batch.output_file_id = remote.get("output_file_id")
        batch.error_file_id = remote.get("error_file_id")
        if batch.status == "failed":
            errors = (remote.get("errors") or {}).get("data") or [{}]
            batch.error_code = str(errors[0].get("code") or "batch_failed")
            log.warning("batch %s failed: %s", batch.remote_id, errors[0])

    async def _find_once(self, local_id: str, created_at: float) -> dict[str, Any] | None:
        after: str | None = None
        while True:
            page = await self.ops.list_batches(after=after, limit=100)
            for remote in page:
                if (remote.get("metadata") or {}).get(METADATA_KEY) == local_id:
                    return remote
            if not page or float(page[-1].get("created_at") or 0) < created_at - 3600:
                return None
            after = str(page[-1]["id"])

    async def poll(self, remote_id: str) -> dict[str, Any]:
        """Wait for the batch to end (a poll, not a retry: an unfinished batch is no
        failure), polling less often as it runs; a provider error is only logged."""
        delay = self.settings.poll_s
        while True:
            try:
                remote = await self.ops.retrieve_batch(remote_id)
                if remote.get("status") in TERMINAL:
                    return remote
            except Transient as exc:  # the provider will be back
                log.warning("polling batch %s: %s", remote_id, exc.message)
            await self.clock.sleep(delay)
            delay = min(delay * 1.5, self.settings.poll_max_s)

    async def with_lines(self, batch: BatchRecord, use: Callable[[BatchLines], T]) -> T:
        """`use` of the batch's output and error lines by custom_id (`core.batch.files`),
        read again while the provider fails (its answers were paid for, and a request
        given an error here would be asked again in a new batch); only so many batches'
        files in use at once, so that memory holds whatever the loop's pace."""
        async with self.files.in_use():
            lines = await self.patiently(
                lambda: self.files.lines(batch.output_file_id, batch.error_file_id),
                f"reading the files of batch {batch.local_id}",
            )
            return use(lines)

    async def patiently(self, ask: Callable[[], Awaitable[T]], what: str) -> T:
        """`ask()` of a batch that exists or may exist, again after each transient failure
        (backoff up to `poll_max_s`) until it answers: its requests' jobs wait meanwhile,
        bounded by their deadline."""
        return await retry_transient(
            ask, what=what, transient=lambda exc: isinstance(exc, Transient), attempts=None,
            first_s=self.settings.poll_s, max_s=self.settings.poll_max_s, sleep=self.clock.sleep,
        )  # fmt: skip


__all__ = [
    "CREATE_GRACE_S",
    "METADATA_KEY",
    "MaybeCreated",
    "RemoteBatches",
    "failure_of",
]
