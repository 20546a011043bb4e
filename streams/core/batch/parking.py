"""Parking: a job of the batch tier gives up waiting for its batch once its request and
its record are durably in the ledger (`Parked`), and is run again when the batch ends;
a job whose partition is gone ends the same way before it asks anything (`Released`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property


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


__all__ = ["Parked", "Parking", "Released", "Resume"]
