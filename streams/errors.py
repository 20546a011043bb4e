"""One exception root and the error taxonomy shared by dead letters, metrics and traces."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Category(StrEnum):
    """Error categories of the record contract (DESIGN.md); the only vocabulary we use."""

    INVALID_INPUT = "invalid_input"
    CONTEXT_OVERFLOW = "context_overflow"
    RATE_LIMITED = "rate_limited"
    TIMEOUT = "timeout"
    UPSTREAM_ERROR = "upstream_error"
    AUTH = "auth"
    BAD_REQUEST = "bad_request"
    INVALID_OUTPUT = "invalid_output"
    CIRCUIT_OPEN = "circuit_open"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    # The answer is valid but its result record is larger than the results topic takes.
    OUTPUT_TOO_LARGE = "output_too_large"
    # Kafka refused the task's outcome for good (record too large, invalid, not authorised).
    WRITE_REFUSED = "write_refused"
    # A bug in the worker, not the task's or the provider's fault.
    INTERNAL_ERROR = "internal_error"


# Dead letters worth sending again once their cause is gone (`llm-streams redrive`): a
# key refused (revoked, expired) is set right by its operator; the others would fail the
# same way: bad input, a request the provider refuses, an answer too large for its
# topic, a write Kafka refuses, a bug in the worker.
REDRIVABLE = (
    Category.AUTH,  # once the key is set right again
    Category.RATE_LIMITED,
    Category.TIMEOUT,
    Category.UPSTREAM_ERROR,
    Category.CIRCUIT_OPEN,
    Category.DEADLINE_EXCEEDED,
    Category.INVALID_OUTPUT,
)


class StreamsError(Exception):
    """Root of every error llm-streams raises on purpose."""

    category: Category = Category.INTERNAL_ERROR
    retryable: bool = False

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.category.value


class NotOurs(Exception):
    """The record's partition is not this worker's to answer (given away, or its local
    store dropped): its outcome is left to the partition's owner, or to the partition's
    start again. No failure of the task: what turns an unexpected error into a dead
    letter lets it through."""


class ConfigError(StreamsError):
    """A setting or a pipeline file is wrong; the process must not start."""

    category = Category.BAD_REQUEST


class TaskError(StreamsError):
    """A task cannot produce a result; it ends as a dead letter of `category`."""


class Transient(TaskError):
    """Worth another attempt: the same request may succeed later.

    `endpoint_down` marks a failure that says the endpoint is failing for everyone
    (its circuit is open after it, or the endpoint cannot be reached): the attempt is
    not charged to the task, whose later attempts wait with backoff and for the
    circuit, bounded by the task's deadline.
    """

    retryable = True
    endpoint_down = False
    # False: the attempt is not charged to the task either — refused before any work in a
    # way the next attempt mends by itself (a parameter the model refuses, left out then).
    charged = True
    # A call sent that got no answer (timed out, dropped mid-way): its prompt's tokens,
    # counted locally (`resilience.guarded.UNANSWERED`); 0 for every other failure.
    unanswered_tokens = 0


class Permanent(TaskError):
    """Retrying the same request cannot succeed."""

    retryable = False


class InvalidInput(Permanent):
    category = Category.INVALID_INPUT


class ContextOverflow(Permanent):
    """The prompt is over the model's window; `window` and `prompt_tokens` are the
    server's own numbers when it said them (in its tokens, not ours)."""

    category = Category.CONTEXT_OVERFLOW

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        window: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.window = window
        self.prompt_tokens = prompt_tokens


class BadRequest(Permanent):
    category = Category.BAD_REQUEST


class NotServed(BadRequest):
    """The endpoint serves no such model (or no such route): a 404 to a chat call. On an
    endpoint that serves several models a pipeline's wrong `model:`; on a deployment,
    which is declared to serve its model, the deployment failing
    (`resilience.guarded`)."""


class AuthError(Permanent):
    """The endpoint refused the key (401) or what the key may do (403). `key_refused`:
    the key itself (revoked, expired, wrong): refused for every call made with it."""

    category = Category.AUTH

    def __init__(self, message: str, *, code: str | None = None, key_refused: bool = False):
        super().__init__(message, code=code)
        self.key_refused = key_refused


class InvalidOutput(Transient):
    """The model answered with something that fails the output contract.

    Transient because a second sample often passes; the retry policy caps it.
    """

    category = Category.INVALID_OUTPUT


class OutputRejected(Permanent):
    """An invalid answer that will not be asked again (e.g. the repair token cap)."""

    category = Category.INVALID_OUTPUT


MINUTE_S = 60.0


@dataclass(frozen=True)
class LimitHit:
    """Which limit a 429 says was hit. `kind`: "requests" or "tokens" (None: it names
    neither); `per_s`: the limit's period in seconds (60: per minute; 86400: a day's
    quota; None: unsaid); `limit` and `requested`: its figures, when said. `partial`: a
    limit on input or output tokens alone, which the limiter's one token bucket (prompt
    and answer together) cannot take as its own."""

    kind: str | None
    per_s: float | None = None
    limit: float | None = None
    requested: float | None = None
    partial: bool = False

    @property
    def quota(self) -> bool:
        """A quota over more than a minute (an hour's, a day's): no pace to learn from."""
        return self.per_s is not None and self.per_s > MINUTE_S

    @property
    def never_fits(self) -> bool:
        """The request alone asks more tokens than the limit ever admits at once."""
        return (self.kind == "tokens" and not self.quota and self.limit is not None
                and self.requested is not None and self.requested > self.limit)  # fmt: skip


class RateLimited(Transient):
    """The provider throttled us; `retry_after` (seconds) is its hint, if it gave one;
    `hit`: which of its limits its body says was hit, if it says."""

    category = Category.RATE_LIMITED

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        hit: LimitHit | None = None,
    ):
        super().__init__(message, code=code)
        self.retry_after = retry_after
        self.headers = headers or {}
        self.hit = hit


class Timeout(Transient):
    category = Category.TIMEOUT


class UpstreamError(Transient):
    """The endpoint failed (5xx, an answer that is no completion, unreachable);
    `retry_after` (seconds): when it said to come back (a 503's `Retry-After`: a model
    loading, a server over capacity), if it did."""

    category = Category.UPSTREAM_ERROR

    def __init__(
        self, message: str, *, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class DeadlineExceeded(Permanent):
    category = Category.DEADLINE_EXCEEDED


class OutputTooLarge(Permanent):
    """The model's answer is valid, but its result does not fit the results topic."""

    category = Category.OUTPUT_TOO_LARGE


class WriteRefused(Permanent):
    """The broker (or the producer before it) refused the outcome's record for a
    reason a retry cannot change."""

    category = Category.WRITE_REFUSED


class InternalError(Permanent):
    """A bug inside the worker: never retried, never redriven as a provider fault."""

    category = Category.INTERNAL_ERROR


class CircuitOpen(Permanent):
    """The endpoint's circuit stays open past the task's deadline."""

    category = Category.CIRCUIT_OPEN
