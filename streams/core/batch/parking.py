"""Parking: a job of the batch tier gives up waiting for its batch once its request and
its record are durably in the ledger (`Parked`), and is run again when the batch ends;
a job whose partition is gone ends the same way before it asks anything (`Released`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from streams.core.batch.ledger import Ledger, job_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parking:
    """The record a job answers, as the edge runs it again (opaque here): made only when
    the job parks (`record()`), not for every record that might."""

    key: str  # one per task answer: its result key
    record: Callable[[], bytes]

    @cached_property
    def packed(self) -> bytes:
        """The record as the ledger keeps it, made once."""
        return self.record()


class Parked(BaseException):  # a way out, like CancelledError, not an error
    """The job's requests wait in batches and its record is durably in the ledger: the job
    ends here without an outcome; the ledger resumes it when its batch ends. A
    BaseException, so that no `except Exception` on the way takes it for a failure."""


class Released(Parked):
    """The job's partition is no longer this worker's: the job ends without an outcome and
    without asking the provider (the ledger it would read is the new owner's now; read
    here it is empty, and a request taken for never sent would be paid again). The
    partition's new owner runs the record: its offset, or its parked entry, is there."""


# resume(partition, job key, record): run a parked job again, once it may find its answer.
Resume = Callable[[int, str, bytes], None]


class Parker:
    """Parks jobs: each one's record goes into the ledger beside its request, if the
    ledger topic takes it (`ledger_bytes`); `parked()` counts each."""

    def __init__(self, ledger: Ledger, ledger_bytes: int, parked: Callable[[], None]) -> None:
        self.ledger = ledger
        self.ledger_bytes = ledger_bytes
        self._parked = parked

    def takes(self, parking: Parking | None) -> bool:
        """Whether a job's record may go into a batch: one the edge runs with a `parking`
        whose record the ledger cannot take would wait for its batch unacked — up to its
        24-h window, holding every rebalance of the group that long — so it is answered by
        a call instead (at the full price, counted)."""
        return parking is None or self.fits(parking)  # None: tests, tools wait as they may

    def fits(self, parking: Parking) -> bool:
        """The ledger topic takes the record."""
        try:
            return len(parking.packed) + 1024 <= self.ledger_bytes
        except Exception:  # a record that cannot be packed cannot be parked
            log.exception("cannot pack the record of %s for the ledger", parking.key)
            return False

    async def park(
        self,
        partition: int,
        parking: Parking,
        answer: asyncio.Future[Any],
        durable: asyncio.Future[bool] | None,
    ) -> bool:
        """True once the request (`durable`) and the job's record are durably in the
        ledger; False (the job waits for its answer, unacked, as without parking) when
        the answer came first or the ledger cannot take the record."""
        if durable is not None:
            waits: list[asyncio.Future[Any]] = [answer, durable]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if answer.done() or not durable.result():
                return False
        if not self.fits(parking):
            return False
        key = job_key(parking.key)
        try:
            record = parking.packed
            if self.ledger.get(partition, key) != record:
                await self.ledger.put(partition, key, record)
            await self.ledger.durable(partition)
        except Exception as exc:  # the broker away, the partition lost: wait as before
            log.warning("could not park job %s of partition %d: %r", parking.key, partition, exc)
            return False
        self._parked()
        return True


__all__ = ["Parked", "Parker", "Parking", "Released", "Resume"]
