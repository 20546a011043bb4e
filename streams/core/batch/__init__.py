"""The batch lane: requests through the provider's Batch API at its batch price, with
the same guarantees as the synchronous lane.

A task of the batch tier runs its job as usual — decode, render, retries, the
output contract, the result or dead letter written through the task store —
except that each attempt's request, instead of a call, is one line of a batch
file (`custom_id` = result key). The job gives its concurrency slot back while
it waits (`parked`); its record stays unacknowledged, so the input offset
commits only once the outcome is written, as in the synchronous lane.

Per task partition, waiting requests are gathered until `max_items`,
`max_bytes` or `linger_s`; the batch is written to the ledger (the store's
ledger map, on the compacted `<app_id>-batch-ledger` topic, partition p) before
it is uploaded and created, then marked submitted with the provider's id, then
polled with backoff. Its requests' answers are matched back by custom_id.

The ledger keeps a worker from sending a request twice: a record that runs again
after a crash or a rebalance finds its request (`item/<custom_id>/<attempt>`)
in a batch and waits for that batch — polling it, or reading its files if it
already ended. A batch recorded as being created but unknown to the provider
(the worker died before creating it; found by its metadata otherwise) is
abandoned and its requests go in a new one.

Parking: a job the edge runs with a `Parking` (the record it answers, handed
down with the task: `Prepared.record`, then `Spend.parking`) does not wait for
its batch. Once its request and the record (`job/<key>`) are durably in the
ledger — broker-acked, or with exactly-once committed — the job ends with
`Parked` and its record is acknowledged: a rebalance never waits for a batch,
and the input offset moves on. The batch is
created only then, so a crash before that sends nothing. When a batch ends, the
owner of its partition resumes the jobs of its requests (`resume`); a new owner
resumes every job of the partition's ledger (`resume_parked`) and so follows
every batch in flight. A resumed job runs the record again: its requests are
found in the ledger, answered from the batch's files, and its answer is written
as usual; then the edge deletes its `job/` entry.

Answers: a 200 line is the attempt's completion; an error line is the attempt's
error in the usual taxonomy (so the usual retries and dead letters follow); a
request the batch did not get to (expired, cancelled, a batch refused for the
enqueued-token limit) is sent again in a new batch, not charged to the task.
"""

from streams.core.batch.lane import BatchLane
from streams.core.batch.ledger import (
    JOB_PREFIX,
    Ledger,
    batch_key,
    erased_key,
    erased_since,
    erasure_mark,
    item_key,
    job_key,
)
from streams.core.batch.parking import Parked, Parking, Released, Resume
from streams.core.batch.wire import BatchOps, error_of, request_line

__all__ = [
    "JOB_PREFIX",
    "BatchLane",
    "BatchOps",
    "Ledger",
    "Parked",
    "Parking",
    "Released",
    "Resume",
    "batch_key",
    "erased_key",
    "erased_since",
    "erasure_mark",
    "error_of",
    "item_key",
    "job_key",
    "request_line",
]
