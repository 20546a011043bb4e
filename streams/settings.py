"""Settings, built once from the environment and passed down.

Every field is read from ``LLM_STREAMS_<SECTION>__<FIELD>`` (for example
``LLM_STREAMS_BATCH__SIZE``); the LLM key and URL also fall back to the OpenAI
SDK's own ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL``, and the key may be read from a file
(``LLM_STREAMS_LLM__API_KEY_FILE`` or ``OPENAI_API_KEY_FILE``), as every secret may. A
variable that starts with ``LLM_STREAMS_`` and is no setting is refused with the nearest
name (a typo would otherwise be ignored), except the few that tools outside the settings
read (``TOOL_VARIABLES``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.errors import ConfigError

ENV_PREFIX = "LLM_STREAMS_"
_PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    """Where `pipelines/` or `schemas/` live: the checkout, else the copy inside the wheel."""
    checkout = _PACKAGE_DIR.parent / name
    if checkout.is_dir():
        return checkout
    return _PACKAGE_DIR / "_data" / name


# How the settings are read: a variable that names no setting is refused, the values are
# frozen, and a number is finite (`inf` is no deadline or price anything here computes
# with: a deadline of inf overflowed Kafka's poll interval at the start). The same as the
# operator's files (`contract.mistakes.WRITTEN`), said here: the settings sit below the
# contract's layer.
_READ = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class _Section(BaseModel):
    model_config = _READ


SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")


class KafkaSecurity(_Section):
    """How every Kafka client of the project authenticates and encrypts
    (`streams.kafka.security` builds the clients' configuration from it, in one place).
    Secrets come from the environment or from files (Kubernetes secrets mounted as
    files); they are never printed."""

    protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."
    )
    ssl_cafile: Path | None = Field(
        None, description="CA bundle (PEM) the broker's certificate is checked against; "
        "default: the system's trusted CAs."
    )  # fmt: skip
    ssl_certfile: Path | None = Field(
        None, description="Client certificate (PEM) for mutual TLS; with SSL_KEYFILE."
    )
    ssl_keyfile: Path | None = Field(None, description="The client certificate's key (PEM).")
    ssl_key_password: SecretStr | None = Field(
        None, description="Password of an encrypted SSL_KEYFILE."
    )
    ssl_key_password_file: Path | None = Field(
        None, description="A file holding SSL_KEY_PASSWORD (instead of the variable)."
    )
    ssl_check_hostname: bool = Field(
        True, description="Check that the broker's certificate names the host connected to."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = (
        Field(None, description="SASL mechanism, with a SASL_* protocol.")
    )
    sasl_username: str | None = Field(None, description="SASL user (PLAIN, SCRAM).")
    sasl_username_file: Path | None = Field(None, description="A file holding SASL_USERNAME.")
    sasl_password: SecretStr | None = Field(None, description="SASL password (PLAIN, SCRAM).")
    sasl_password_file: Path | None = Field(None, description="A file holding SASL_PASSWORD.")
    sasl_oauth_token_provider: str | None = Field(
        None, description="OAUTHBEARER: `module:name` of an aiokafka AbstractTokenProvider "
        "(a class, made with no arguments, or an instance)."
    )  # fmt: skip
    sasl_oauth_msk_region: str | None = Field(
        None, description="OAUTHBEARER on AWS MSK with IAM: the cluster's region (needs the "
        "`msk` extra: aws-msk-iam-sasl-signer-python)."
    )  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        name = "LLM_STREAMS_KAFKA__SECURITY__"
        tls = self.protocol in ("SSL", "SASL_SSL")
        sasl = self.protocol.startswith("SASL_")
        if not tls and any((self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)):
            raise ValueError(f"{name}SSL_* files are set but {name}PROTOCOL is "
                             f"{self.protocol}: use SSL or SASL_SSL")  # fmt: skip
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(f"{name}SSL_CERTFILE and {name}SSL_KEYFILE go together "
                             "(mutual TLS)")  # fmt: skip
        if not sasl and self.sasl_mechanism is not None:
            raise ValueError(f"{name}SASL_MECHANISM is set but {name}PROTOCOL is "
                             f"{self.protocol}: use SASL_PLAINTEXT or SASL_SSL")  # fmt: skip
        if sasl and self.sasl_mechanism is None:
            raise ValueError(f"{name}PROTOCOL {self.protocol} needs {name}SASL_MECHANISM "
                             f"({', '.join(SASL_MECHANISMS)})")  # fmt: skip
        if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            if self.sasl_username is None and self.sasl_username_file is None:
                raise ValueError(f"{self.sasl_mechanism} needs {name}SASL_USERNAME "
                                 f"(or {name}SASL_USERNAME_FILE)")  # fmt: skip
            if self.sasl_password is None and self.sasl_password_file is None:
                raise ValueError(f"{self.sasl_mechanism} needs {name}SASL_PASSWORD "
                                 f"(or {name}SASL_PASSWORD_FILE)")  # fmt: skip
        if self.sasl_mechanism == "OAUTHBEARER" and (
            (self.sasl_oauth_token_provider is None) == (self.sasl_oauth_msk_region is None)
        ):
            raise ValueError(f"OAUTHBEARER needs one of {name}SASL_OAUTH_TOKEN_PROVIDER "
                             f"and {name}SASL_OAUTH_MSK_REGION")  # fmt: skip
        return self


class KafkaSettings(_Section):
    broker_url: str = Field(
        "kafka://127.0.0.1:9092", description="Bootstrap servers, `kafka://host:port[;host:port]`."
    )
    partitions: int = Field(4, ge=1, description="Partitions for topics llm-streams creates.")
    replication_factor: int = Field(1, ge=1, description="Replication of topics it creates.")
    session_timeout_s: float = Field(
        10.0, gt=0, description="Consumer group session timeout (Tansu joins take half of it)."
    )
    commit_interval_s: float = Field(0.5, gt=0, description="How often acked offsets commit.")
    consumer_thread: bool = Field(
        False,
        description="Run the worker's Kafka consumer in a thread of its own, as Faust does by "
        "default, instead of on the worker's event loop: more CPU per task at thin traffic; "
        "only for pipeline code that can block the loop for seconds.",
    )
    fetch_max_wait_ms: int = Field(
        500, ge=1, le=10_000,
        description="How long the worker's fetch at the end of its partitions waits on the "
        "broker for records (Faust's own: 1,500). Apache Kafka answers as soon as a record "
        "comes, so this only paces idle fetches; a broker that answers at the end of the "
        "wait (the demo's Tansu) adds up to this much to every record.",
    )  # fmt: skip
    replay_idle_check_s: float = Field(
        2.0, ge=0, le=60,
        description="How often the worker checks whether the replay topic's partitions it "
        "has read to their end received records. Until they do they are left out of its "
        "fetches (each fetch carries and answers every partition asked for; at thin traffic "
        "the idle replay lane was ~11% of the worker's work a task), so a replay starts "
        "within this much. 0: always fetched. The consumer on its own thread "
        "(`consumer_thread`) always fetches them.",
    )  # fmt: skip
    idempotent_producer: bool = Field(
        False, description="Kafka idempotent producer; Tansu cannot do it, keep off there."
    )
    startup_wait_s: float = Field(
        300.0,
        ge=0,
        description="How long a worker that starts while Kafka is away (connections refused "
        "or unanswered: a broker restarting, a failover) waits for it, trying again with "
        "backoff and a log line per try, before it gives up. A wrong address, a refused "
        "credential or an untrusted certificate fails at once.",
    )
    max_request_bytes: int = Field(
        1_048_576,
        ge=65_536,
        description="Largest record any producer of the project sends (the producer's "
        "max_request_size); records are cut to fit it and each topic's max.message.bytes.",
    )
    security: KafkaSecurity = KafkaSecurity()

    @field_validator("broker_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        hosts = bootstrap_servers(v)
        if not hosts or any(":" not in h for h in hosts.split(",")):
            raise ValueError("expected kafka://host:port[;host:port...]")
        return v


class TopicSettings(_Section):
    tasks: str = Field("llm-tasks", min_length=1, description="Live task input topic.")
    replay: str = Field("llm-tasks-replay", min_length=1, description="Replay lane input topic.")
    results: str = Field("llm-results", min_length=1, description="Results (compacted).")
    dead_letters: str = Field("llm-dead-letters", min_length=1, description="Dead letters.")
    review: str = Field("llm-review", min_length=1, description="Low-confidence results.")


class BatchSettings(_Section):
    size: int = Field(100, ge=1, le=10_000, description="Max records in one micro-batch.")
    window_s: float = Field(
        0.05, gt=0, le=60, description="Max wait to fill a micro-batch, from its first record."
    )
    concurrency: int = Field(
        64, ge=1, le=10_000, description="Max tasks in flight per worker (LLM calls included)."
    )
    max_task_bytes: int = Field(
        65_536, ge=256, description="Task records above this size are dead-lettered."
    )
    live_reserve: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="Share of `concurrency` the replay lane never uses, kept for live tasks.",
    )
    buffer: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Records fetched ahead of the agent; beyond it fetching pauses (backpressure).",
    )


class LLMSettings(_Section):
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint; OPENAI_BASE_URL.")
    api_key: SecretStr | None = Field(None, description="API key; OPENAI_API_KEY.")
    api_key_file: Path | None = Field(
        None, description="A file holding the API key (wins over API_KEY); OPENAI_API_KEY_FILE."
    )
    model: str = Field("gpt-4o-mini", min_length=1, description="Default model.")
    deployments_file: Path | None = Field(
        None,
        description="A YAML file of deployments (`llm.deployments`): the endpoints, keys, "
        "limits and prices that serve each model name, calls routed among a model's by "
        "headroom. Unset: BASE_URL and API_KEY serve every model.",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Per-attempt connect timeout.")
    read_timeout_s: float = Field(30.0, gt=0, description="Per-attempt read timeout.")
    max_attempts: int = Field(4, ge=1, le=20, description="Attempts per task for retryable errors.")
    backoff_base_s: float = Field(0.5, ge=0, description="First retry's backoff cap.")
    backoff_max_s: float = Field(20.0, ge=0, description="Largest single backoff.")
    task_deadline_s: float = Field(120.0, gt=0, description="Total time a task may spend.")
    rpm: float | None = Field(
        None, gt=0, description="Requests/min to start from; x-ratelimit headers then steer it."
    )
    tpm: float | None = Field(
        None, gt=0, description="Tokens/min to start from; x-ratelimit headers then steer it."
    )
    startup_wait_s: float = Field(
        300.0,
        ge=0,
        description="How long a worker that starts while the LLM endpoint cannot be reached "
        "(refused, no answer) waits for it, trying again with backoff and a line per try, "
        "before it gives up. A wrong host or a refused key fails at once.",
    )
    context_window: int | None = Field(
        None,
        ge=256,
        description="The model's context window, in its tokens. Unset: as the endpoint says "
        "(llama.cpp, vLLM, model lists that carry it), else learned from its first overflow "
        "error (128,000 until then). Set it for an endpoint that cuts prompts silently (Ollama).",
    )
    burst_s: float = Field(
        1.0, gt=0, le=60, description="Seconds of the limit one burst may use (sub-minute)."
    )

    @field_validator("base_url", "api_key", "api_key_file", "deployments_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        # `OPENAI_BASE_URL: ${OPENAI_BASE_URL:-}` in compose gives "" for "not given".
        return None if isinstance(v, str) and not v.strip() else v

    price_per_1k_prompt_usd: float = Field(0.00015, ge=0, description="Price table: input.")
    price_per_1k_completion_usd: float = Field(0.0006, ge=0, description="Price table: output.")
    price_per_1k_cached_prompt_usd: float | None = Field(
        None, ge=0,
        description="Price table: an input token the provider says it read from its prompt "
        "cache (usage.prompt_tokens_details.cached_tokens); unset: the input price.",
    )  # fmt: skip


class BatchApiSettings(_Section):
    """The batch lane: requests sent through the provider's Batch API at its batch price."""

    max_items: int = Field(
        50_000, ge=1, le=50_000, description="Requests per batch file (provider cap 50,000)."
    )
    max_bytes: int = Field(
        200 * 1024 * 1024, ge=1024, description="Size of one batch file (provider cap 200 MB)."
    )
    linger_s: float = Field(
        10.0, gt=0, description="How long a partition's first waiting request waits for more."
    )
    poll_s: float = Field(5.0, gt=0, description="First wait between polls of a batch.")
    poll_max_s: float = Field(60.0, gt=0, description="Longest wait between polls.")
    max_enqueued_tokens: int = Field(
        0, ge=0, description="Provider's enqueued-token limit (0: none); submit within it."
    )
    max_pending: int = Field(
        50_000,
        ge=1,
        description="Requests a worker holds at once for batches (being taken in, or "
        "waiting for their batch where no record is parked: the Python API, tools).",
    )
    files_cache_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="Bytes of finished batches' output and error files a worker keeps "
        "(least recently used out first; the newest file is kept even when it alone is "
        "larger): a resumed job reads its answer without downloading its file again.",
    )
    deadline_s: float = Field(
        93_600.0, gt=0, description="Total time a batch-lane task may take (26 h)."
    )
    intake_per_s: float = Field(
        100.0,
        gt=0,
        description="Requests a worker takes into batches per second, and answers of "
        "finished batches it hands back per second: a replay of 50,000 tasks must not "
        "take the CPU from live tasks while it is queued or while its results are written.",
    )
    price_ratio: float = Field(
        0.5, gt=0, le=1, description="Batch (and flex) price as a share of the price table."
    )


class ResilienceSettings(_Section):
    breaker_window_s: float = Field(30.0, gt=0, description="Breaker's sliding window.")
    breaker_min_calls: int = Field(20, ge=1, description="Calls in the window before it judges.")
    breaker_failure_rate: float = Field(
        0.5, gt=0, le=1, description="Share of timeouts/5xx in the window that opens it."
    )
    breaker_open_s: float = Field(15.0, gt=0, description="Open time before half-open probes.")
    breaker_probes: int = Field(3, ge=1, description="Probe calls while half-open.")
    breaker_slow_call_s: float = Field(
        10.0,
        gt=0,
        description="An attempt still unanswered at its task's deadline counts as an "
        "endpoint failure once it has waited this long (a hung endpoint opens the circuit).",
    )


class RetentionSettings(_Section):
    """How long the task store keeps each map's entries, per task partition: by age (days
    since the entry was last written) and/or count (the newest N); 0 means no limit. An
    expired result, task state or ledger entry is deleted from the worker's local copy and
    tombstoned on its compacted topic (a result leaves the results topic too); an
    expired dead-letter entry leaves the local copy only (the dead-letter topic keeps its
    own retention). What expiry means: a task whose result and state expired is answered
    again (an LLM call) when a record of it comes, under the same result key."""

    results_days: float = Field(0.0, ge=0, description="Age after which a result expires.")
    results_max: int = Field(0, ge=0, description="Results kept per partition, newest first.")
    tasks_days: float = Field(0.0, ge=0, description="Age after which a task state expires.")
    tasks_max: int = Field(0, ge=0, description="Task states kept per partition.")
    dead_letters_days: float = Field(
        7.0,
        ge=0,
        description="Age after which a dead letter leaves the local copy (default: the "
        "dead-letter topic's default retention). A record runs again only while its offset "
        "is uncommitted, and a dead-lettered task's state records it as well.",
    )
    dead_letters_max: int = Field(0, ge=0, description="Dead letters kept per partition.")
    ledger_days: float = Field(
        7.0,
        ge=0,
        description="Age after which a batch-lane ledger entry expires; longer than a "
        "batch-lane task may take (LLM_STREAMS_BATCH_API__DEADLINE_S).",
    )
    sessions_days: float = Field(
        7.0,
        ge=0,
        description="Idle time (days since its last turn) after which a session's turns "
        "expire: a later turn of it starts a new conversation.",
    )
    sessions_max: int = Field(0, ge=0, description="Sessions kept per partition.")
    check_s: float = Field(60.0, gt=0, description="How often expired entries are looked for.")

    def limits(self) -> dict[str, tuple[float, int]]:
        """Map name -> (days, max entries), the maps that have a limit."""
        found = {
            name: (getattr(self, f"{name}_days"), getattr(self, f"{name}_max", 0))
            for name in ("results", "tasks", "dead_letters", "ledger", "sessions")
        }
        return {name: limit for name, limit in found.items() if any(limit)}


class SchemaRegistrySettings(_Section):
    """The schema registry of sources with `format: registry` (Confluent's REST API)."""

    url: str | None = Field(None, description="Registry base URL, e.g. http://registry:8081.")
    username: str | None = Field(None, description="Basic auth user (Confluent Cloud: API key).")
    password: SecretStr | None = Field(None, description="Basic auth password (API secret).")
    ca_file: Path | None = Field(None, description="CA bundle (PEM) for an https registry.")
    timeout_s: float = Field(10.0, gt=0, description="Per-request timeout.")
    retry_max_s: float = Field(
        30.0, gt=0, description="Longest wait between tries while the registry is unavailable."
    )
    cache_size: int = Field(1000, ge=1, description="Schemas (by id) kept in memory.")
    unknown_ttl_s: float = Field(
        60.0, ge=0, description="How long an id the registry did not know is not asked again."
    )

    @model_validator(mode="after")
    def _auth_in_pairs(self) -> SchemaRegistrySettings:
        if (self.username is None) != (self.password is None):
            raise ValueError("LLM_STREAMS_SCHEMA_REGISTRY__USERNAME and __PASSWORD go together")
        return self


class TracingSettings(_Section):
    exporter: Literal["none", "otlp", "file"] = Field(
        "none",
        description="Where spans go: nowhere (trace ids still flow; only a trace sampled "
        "upstream is recorded, a trace begun here is not), OTLP over HTTP "
        "(OTEL_EXPORTER_OTLP_ENDPOINT etc. as the exporter reads them), or a JSON-lines file.",
    )
    file: Path | None = Field(None, description="With exporter=file: the file spans go to.")
    service_name: str = Field("llm-streams", min_length=1, description="service.name resource.")


class DriftSettings(_Section):
    window: int = Field(
        1000, ge=10, le=100_000,
        description="Answers per prompt version in the worker's drift window (the latest).",
    )  # fmt: skip
    refresh_s: float = Field(
        30.0, gt=0, description="How often the worker reads the stored drift baselines."
    )


class BudgetSettings(_Section):
    refresh_s: float = Field(
        15.0, gt=0,
        description="How often the worker saves its partitions' spend under the caps and "
        "reads the caps set by `llm-streams budget`.",
    )  # fmt: skip


class Settings(BaseSettings):
    """All settings of a worker or a CLI command."""

    # As the sections', with where the environment's names begin.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", **cast(SettingsConfigDict, _READ)
    )

    app_id: str = Field("llm-streams", min_length=1, description="Consumer group / app id.")
    kafka: KafkaSettings = KafkaSettings()
    topics: TopicSettings = TopicSettings()
    batch: BatchSettings = BatchSettings()
    llm: LLMSettings = LLMSettings()
    resilience: ResilienceSettings = ResilienceSettings()
    batch_api: BatchApiSettings = BatchApiSettings()
    retention: RetentionSettings = RetentionSettings()
    tracing: TracingSettings = TracingSettings()
    drift: DriftSettings = DriftSettings()
    budget: BudgetSettings = BudgetSettings()
    schema_registry: SchemaRegistrySettings = SchemaRegistrySettings()
    store: str = Field(
        "rocksdb://",
        description="Task store maps: rocksdb://[path] (on disk, default: data dir/store; "
        "a restart reads only what the topics gained since) or memory:// (read again from "
        "the topics on every assignment; memory grows with the history).",
    )
    store_cache_mb: int = Field(
        64,
        ge=8,
        le=65536,
        description="Memory the on-disk task store may use for all its partitions (block "
        "cache and write buffers): what bounds a worker's memory, whatever the history.",
    )
    store_unflushed_mb: int = Field(
        256,
        ge=1,
        le=65536,
        description="Writes the on-disk task store may hold in memory while its disk "
        "refuses them (full, failing): past it, records wait before they run (unacked: "
        "nothing lost, the consumer lag grows) until a flush succeeds; its topics hold the "
        "writes meanwhile.",
    )
    store_cleanup_after_s: float = Field(
        600.0,
        ge=0,
        description="A partition's on-disk store is deleted once the worker has not owned "
        "it for this long (kept meanwhile: a partition coming back reads only what it "
        "missed).",
    )
    store_standby_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description="Warm copies of each task partition's store kept by other workers (as "
        "Kafka Streams' num.standby.replicas): a worker follows the changelogs of the "
        "partitions it stands by for into its on-disk store, and a rebalance gives a "
        "partition whose owner left to a worker standing by for it, which then reads only "
        "what it had not followed yet. Each costs a partition's disk and a reader per "
        "partition on the worker holding it; needs rocksdb://.",
    )
    processing_guarantee: Literal["at_least_once", "exactly_once"] = "at_least_once"
    data_dir: Path = Field(Path("var/llm-streams"), description="Worker state directory.")
    pipelines_dir: Path = Field(default_factory=lambda: _data_dir("pipelines"))
    schemas_dir: Path = Field(default_factory=lambda: _data_dir("schemas"))
    shutdown_grace_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        description="On SIGTERM, how long in-flight tasks get to finish and write before the "
        "worker exits anyway, leaving the rest unacknowledged for the next owner. Keep it "
        "below the pod's terminationGracePeriodSeconds.",
    )
    web_port: int = Field(6066, ge=0, le=65535, description="Worker web/metrics port.")
    web_bind: str = Field(
        "127.0.0.1", description="Address the web port binds: 0.0.0.0 in containers."
    )
    log_level: str = Field("info", description="Worker log level.")
    log_format: Literal["text", "json"] = Field(
        "text", description="Worker log lines: text, or JSON objects with task_id."
    )

    @model_validator(mode="after")
    def _ledger_outlives_batches(self) -> Settings:
        days = self.retention.ledger_days
        if days and days * 86_400 <= self.batch_api.deadline_s:
            raise ValueError(
                f"LLM_STREAMS_RETENTION__LEDGER_DAYS={days:g} would expire batches still "
                f"running: keep it above LLM_STREAMS_BATCH_API__DEADLINE_S "
                f"({self.batch_api.deadline_s / 86_400:.2f} days), or 0"
            )
        return self

    @model_validator(mode="after")
    def _standbys_on_disk(self) -> Settings:
        if self.store_standby_replicas and self.store == "memory://":
            raise ValueError(
                "LLM_STREAMS_STORE_STANDBY_REPLICAS needs an on-disk store (rocksdb://): "
                "memory:// reads every partition again on its assignment, a warm copy or not"
            )
        return self

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        if not (v == "memory://" or v.startswith("rocksdb://")):
            raise ValueError("expected memory:// or rocksdb://[path]")
        return v

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, v: str) -> str:
        if v.lower() not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError("expected debug|info|warning|error|critical")
        return v.lower()

    @property
    def bootstrap_servers(self) -> str:
        return bootstrap_servers(self.kafka.broker_url)


def bootstrap_servers(url: str) -> str:
    """`kafka://a:1;b:2` (Faust's form) -> `a:1,b:2` (aiokafka's form)."""
    hosts = [h.strip().removeprefix("kafka://") for h in url.replace(";", ",").split(",")]
    return ",".join(h for h in hosts if h)


def env_name(loc: tuple[int | str, ...]) -> str:
    """The environment variable that sets the field at `loc`."""
    return ENV_PREFIX + "__".join(str(p).upper() for p in loc)


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the process environment plus explicit overrides.

    Raises ConfigError naming the environment variable of every invalid field, and of
    every `LLM_STREAMS_*` variable that is no setting.
    """
    _refuse_unknown(os.environ)
    llm = dict(overrides.pop("llm", {}) or {})
    for ours, theirs, field in (
        ("LLM__API_KEY", "OPENAI_API_KEY", "api_key"),
        ("LLM__API_KEY_FILE", "OPENAI_API_KEY_FILE", "api_key_file"),
        ("LLM__BASE_URL", "OPENAI_BASE_URL", "base_url"),
    ):
        if ENV_PREFIX + ours not in os.environ and theirs in os.environ:
            llm.setdefault(field, os.environ[theirs])
    if llm:
        overrides["llm"] = llm
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{env_name(e['loc'])}: {e['msg']}{_got(e['loc'], e.get('input'))}"
            if e["loc"]
            else e["msg"].removeprefix("Value error, ")  # a rule between settings
            for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
    return _with_key_file(settings)


def _with_key_file(settings: Settings) -> Settings:
    path = settings.llm.api_key_file
    if path is None:
        return settings
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            f"{ENV_PREFIX}LLM__API_KEY_FILE: cannot read {path}: {exc.strerror}"
        ) from None
    if not key:
        raise ConfigError(f"{ENV_PREFIX}LLM__API_KEY_FILE: {path} is empty")
    llm = settings.llm.model_copy(update={"api_key": SecretStr(key)})
    return settings.model_copy(update={"llm": llm})


# Read by tools beside the settings (the test suite's brokers and model, the dev registry),
# never by a worker: the only `LLM_STREAMS_*` names that are no setting.
TOOL_VARIABLES = frozenset(
    ENV_PREFIX + name
    for name in ("KAFKA_JARS", "SCHEMA_REGISTRY_BIN", "LLAMA_MODEL", "TEST_DOCKER")
)


def setting_variables() -> list[str]:
    """Every variable that sets a field (sections by their fields, as the env source reads)."""
    names: list[str] = []

    def walk(loc: tuple[str, ...], model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                walk((*loc, name), kind)
            else:
                names.append(env_name((*loc, name)))

    walk((), Settings)
    return names


def _refuse_unknown(environ: Mapping[str, str]) -> None:
    """A top-level typo (`LLM_STREAMS_BATCHSIZE`) is refused as a nested one is (the env
    source drops names it cannot place, and the typo's setting would keep its default)."""
    known = setting_variables()
    sections = {n.split("__")[0] for n in known if "__" in n}
    tops = {n for n in known if "__" not in n}
    problems = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in TOOL_VARIABLES:
            continue
        head = var.split("__")[0] if "__" in var else var
        if head in sections if "__" in var else var in tops:
            continue  # a field, or a section's (its field is checked by the section)
        near = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        problems.append(f"{var} is no setting" + (f" (did you mean {near[0]}?)" if near else ""))
    if problems:
        raise ConfigError("; ".join(problems) + " — see docs/SETTINGS.md")


_SECRET_PARTS = ("security", "api_key", "password", "token")


def _got(loc: tuple[int | str, ...], value: Any) -> str:
    """The refused value, for the message — unless it is (or may hold) a secret."""
    if isinstance(value, dict) or any(part in str(name) for name in loc for part in _SECRET_PARTS):
        return ""
    return f" (got {value!r})"


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment variables that rebuild `settings` in another process (e.g. a worker)."""
    env: dict[str, str] = {}

    def put(loc: tuple[str, ...], value: Any) -> None:
        if value is None:
            return
        if isinstance(value, BaseModel):
            for name in type(value).model_fields:
                put((*loc, name), getattr(value, name))
            return
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[env_name(loc)] = str(value)

    for name in Settings.model_fields:
        put((name,), getattr(settings, name))
    return env
