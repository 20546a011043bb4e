"""A local OpenAI-compatible endpoint for tests, benchmarks and the demo.

It answers `/v1/chat/completions` and `/v1/models` like OpenAI does, including
rate limits enforced at sub-minute granularity (429 with `Retry-After`,
`retry-after-ms` and `x-ratelimit-*` headers on every response), 500/503s,
hangs, malformed content, context-length 400s and an API-key check. Knobs can
be changed while it runs (`POST /sim/config`); `GET /sim/stats` counts
requests by status and outcome and the duplicate successful calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import math
import random
import re
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from streams.dev import sim_batch, sim_content
from streams.dev.sim_limits import HEADER_STYLES, SimLimits, refusal
from streams.llm.client import SCHEMA_IN_PROMPT
from streams.llm.tokens import count_messages, counter

# Answered prompts remembered for the duplicate count: ~80 MB at the most (a 16-byte
# fingerprint and its place in an ordered dict each); a test or a bench asks far fewer.
REMEMBERED_PROMPTS = 500_000


@dataclass
class SimConfig:
    """Behaviour knobs; rates are probabilities per request."""

    latency_ms: float = 0.0
    latency_jitter_ms: float = 0.0
    latency_dist: str = "uniform"  # fixed | uniform | normal | lognormal
    max_concurrency: int = 0  # 0 = unlimited; above it requests queue
    rpm: int = 0  # 0 = no request limit
    tpm: int = 0  # 0 = no token limit
    burst_s: float = 1.0  # enforcement window: 60 RPM admits ~1 per second, not 60 at once
    # How the limits are enforced: `bucket` (refilled continuously, holding `burst_s` of
    # the rate) or `window` (a fixed budget per `window_s`, reset at each window's end).
    limit_shape: str = "bucket"
    window_s: float = 60.0
    # The window `x-ratelimit-remaining-*` is counted against: 60, the minute, as OpenAI
    # reports it; or the enforcing window (e.g. 1), as some gateways and providers do.
    remaining_window_s: float = 60.0
    # Send the `x-ratelimit-*` headers (OpenAI does); False: a provider that enforces
    # its limits and says nothing of them, only 429s with Retry-After.
    rate_headers: bool = True
    # Answer as a reasoning model served without a reasoning parser (vLLM without one,
    # Ollama, LM Studio): its thinking in `<think>...</think>` before the answer's text.
    reasoning_in_content: bool = False
    # Whose headers, and 429s' words, say the limits (`dev.sim_limits.HEADER_STYLES`).
    header_style: str = "openai"
    error_500_rate: float = 0.0
    error_500_models: list[str] = field(default_factory=list)  # these models always answer 500
    error_503_rate: float = 0.0
    error_503_retry_after_s: float = 0.0  # a 503's Retry-After (0: none said)
    hang_rate: float = 0.0
    hang_s: float = 600.0
    malformed_rate: float = 0.0
    # Prompts that do worse: marker -> malformed rate for requests whose messages contain
    # the marker (e.g. a phrase only one prompt version has), instead of `malformed_rate`.
    malformed_if_prompt_has: dict[str, float] = field(default_factory=dict)
    # Drifting answers: with probability `shift_rate`, a JSON answer's fields named here
    # take these values instead (e.g. {"sentiment": "negative"}) whatever the text says.
    shift_fields: dict[str, Any] = field(default_factory=dict)
    shift_rate: float = 0.0
    packed_drop_items: int = 0  # packed answers leave out this many items
    flex_latency_factor: float = 3.0  # service_tier=flex answers this much slower
    flex_unavailable_rate: float = 0.0  # share of flex calls refused: 429 resource_unavailable
    # Models that offer no flex tier: a flex call is a 400 "Unsupported service_tier: flex",
    # as OpenAI answers it for a model without one.
    flex_refused_models: list[str] = field(default_factory=list)
    batch_delay_s: float = 2.0  # Batch API: a batch finishes this long after its creation
    batch_item_error_rate: float = 0.0  # share of batch lines answered with a 500
    batch_expire_next: int = 0  # this many next batches expire instead of completing
    batch_expire_fraction: float = 0.5  # share of an expiring batch's lines answered
    batch_token_limit: int = 0  # enqueued-token limit over unfinished batches (0: none)
    # This many next batch creations make the batch and answer 502 (the answer lost on
    # the way, as a gateway or a dropped connection does): a client that retries blindly
    # makes a second batch and pays twice.
    batch_create_lost_next: int = 0
    packed_invalid_items: int = 0  # and break the schema for this many
    # Refuse `response_format: json_schema` with a 500, as llama-cpp-python's server does.
    refuses_json_schema: bool = False
    # Models that refuse sampling and `max_tokens` as OpenAI's reasoning models do (o-series,
    # gpt-5): `max_tokens` not supported ("use max_completion_tokens"), a temperature or
    # top_p other than 1 not supported — each a 400 in OpenAI's words.
    reasoning_models: list[str] = field(default_factory=list)
    # Answer prose whatever `response_format` asks (as endpoints that ignore it do); a
    # forced function call and a schema in the prompt are still followed.
    ignores_response_format: bool = False
    long_answer_chars: int = 0  # json_schema answers of these models: first string field
    long_answer_models: list[str] = field(default_factory=list)  # padded to this length
    context_window: int = 128_000
    # A prompt cache as OpenAI's: a request whose first message was sent before, and is at
    # least this many tokens, says those tokens were cached (usage.prompt_tokens_details.
    # cached_tokens; OpenAI caches from 1,024). None: no cache, nothing said.
    prompt_cache_min_tokens: int | None = None
    # The token usage its answers say: `said`, `none` (no usage block, as some gateways and
    # older local servers answer) or `zeros` (every count 0).
    usage: str = "said"
    api_key: str | None = None
    models: list[str] = field(default_factory=lambda: ["sim-1", "gpt-4o-mini"])
    # A chat call for a model not in `models` refused as OpenAI, vLLM and Ollama refuse
    # one (404 `model_not_found`); False: every name answered, as llama.cpp answers.
    models_only: bool = False
    seed: int = 0
    # Whose server it plays: `openai`, or `llama.cpp` — its own HTTP server's shapes, as
    # measured against a real one (KNOWLEDGE.md): no x-ratelimit headers, `Server:
    # llama.cpp`, `/props` (`n_ctx` = context_window, `total_slots` = max_concurrency,
    # whose requests beyond queue), `meta.n_ctx` in `/v1/models`, its overflow and auth
    # error bodies, `timings` in every answer, `service_tier` ignored and never echoed,
    # a forced tool call in the object form refused (the answer comes as content: fenced
    # JSON text).
    server: str = "openai"

    def update(self, changes: dict[str, Any]) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise ValueError(f"unknown simulator settings: {sorted(unknown)}")
        style = changes.get("header_style", self.header_style)
        if style not in HEADER_STYLES:
            raise ValueError(f"header_style {style!r}: one of {', '.join(HEADER_STYLES)}")
        for key, value in changes.items():
            setattr(self, key, value)


REASONING = (
    '<think>\nThe user wants the comment analysed. It reads {"sentiment": ...} '
    "in my head first; then the JSON.\n</think>\n\n"
)


def _error(
    status: int, message: str, etype: str | None, code: str | None, headers: dict[str, str]
) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": code}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def _unsupported_param(body: dict[str, Any]) -> tuple[str, str] | None:
    """What an OpenAI reasoning model refuses of a request body (code, message), or None."""
    if "max_tokens" in body:
        return ("unsupported_parameter", "Unsupported parameter: 'max_tokens' is not supported "
                "with this model. Use 'max_completion_tokens' instead.")  # fmt: skip
    for name in ("temperature", "top_p"):
        if name in body and body[name] != 1:
            return ("unsupported_value", f"Unsupported value: '{name}' does not support "
                    f"{body[name]} with this model. Only the default (1) value is "
                    "supported.")  # fmt: skip
    return None


def percentile(values: Iterable[float], q: float) -> float:
    """The `q` quantile of `values` (0 < q < 1), nearest rank; 0 when there are none. The
    one rule of the simulator's figures, the demo's summary and bench/'s."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _percentiles(values: deque[float]) -> dict[str, float]:
    """p50 and p99 of `values` (0 when there are none), and how many."""
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "n": len(values)}


class Simulator:
    """The aiohttp application and its counters."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.rng = random.Random(self.config.seed)
        self.limits = SimLimits(self.config.window_s)  # rpm and tpm, as configured
        self.by_status: Counter[int] = Counter()
        self.by_outcome: Counter[str] = Counter()
        # The latest REMEMBERED_PROMPTS answered prompts, by a 16-byte fingerprint: one
        # answered again while remembered is a duplicate success (a test's proof that
        # nothing was paid twice). A simulator left running (the compose file's llm-sim,
        # 3,000 RPM: 4.3 M prompts a day) forgets the oldest instead of growing for good.
        self.answered: OrderedDict[bytes, None] = OrderedDict()
        self.successful_prompts = 0  # distinct while remembered
        self.duplicate_successes = 0
        # The latest chat requests' messages, oldest first (tests read the prompts sent).
        self.chats: deque[list[dict[str, Any]]] = deque(maxlen=10_000)
        self.cached_prefixes: OrderedDict[str, int] = OrderedDict()  # first messages sent
        self.prompt_tokens = 0
        self.charged_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self.max_in_flight = 0
        # Milliseconds from each answered request's arrival to its answer: the endpoint's
        # own time, beyond its configured latency too (reading, counting tokens, JSON).
        self.service_ms: deque[float] = deque(maxlen=100_000)
        self.started = time.monotonic()
        self.per_second: dict[int, Counter[int]] = {}
        self._sem: asyncio.Semaphore | None = None
        self._sem_size = 0
        self.count_tokens = counter()
        self.app = web.Application(client_max_size=32 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        # Azure OpenAI's shape: the deployment in the path, `api-version` asked, `api-key`.
        self.app.router.add_post("/openai/deployments/{deployment}/chat/completions", self.chat)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/props", self.props)
        self.app.router.add_get("/sim/stats", self.stats)
        self.app.router.add_post("/sim/config", self.set_config)
        self.app.router.add_get("/sim/config", self.get_config)
        self.app.router.add_post("/sim/reset", self.reset)
        self.batch = sim_batch.BatchAPI(self, self._content)

    # -- admin ---------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": sum(self.by_status.values()),
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_outcome": dict(sorted(self.by_outcome.items())),
            "successful_prompts": self.successful_prompts,
            "duplicate_successes": self.duplicate_successes,
            "prompt_tokens": self.prompt_tokens,
            "charged_tokens": self.charged_tokens,  # what admitted requests took of the TPM
            "completion_tokens": self.completion_tokens,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "now_s": time.monotonic() - self.started,
            "service_ms": _percentiles(self.service_ms),
            **self.batch.snapshot(),
            "per_second": {
                str(sec): {str(k): v for k, v in c.items()}
                for sec, c in sorted(self.per_second.items())
            },
        }

    def _remember(self, prompt: bytes) -> None:
        """A successful answer to `prompt`: counted, a duplicate when it is remembered."""
        fingerprint = hashlib.blake2b(prompt, digest_size=16).digest()
        if fingerprint in self.answered:
            self.duplicate_successes += 1
            self.answered.move_to_end(fingerprint)
            return
        self.successful_prompts += 1
        self.answered[fingerprint] = None
        if len(self.answered) > REMEMBERED_PROMPTS:
            self.answered.popitem(last=False)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def get_config(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.config))

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            self.config.update(await request.json())
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(dataclasses.asdict(self.config))

    async def reset(self, request: web.Request) -> web.Response:
        self.by_status.clear()
        self.by_outcome.clear()
        self.answered.clear()
        self.successful_prompts = self.duplicate_successes = 0
        self.prompt_tokens = self.completion_tokens = self.charged_tokens = 0
        self.max_in_flight = self.in_flight
        self.per_second.clear()
        self.service_ms.clear()
        # The limits start afresh too (full buckets, a new window): a bench phase after a
        # reset does not inherit the last phase's spent capacity.
        self.limits.reset()
        return web.json_response(self.snapshot())

    @property
    def llama(self) -> bool:
        return self.config.server == "llama.cpp"

    async def models(self, request: web.Request) -> web.Response:
        if (denied := self.auth(request, count=False)) is not None:  # not a chat request
            return denied
        data: list[dict[str, Any]] = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llm-streams-sim"}
            for m in self.config.models
        ]
        if self.llama:
            data = [{**d, "owned_by": "llamacpp", "meta": {"n_ctx": self.config.context_window}}
                    for d in data[:1]]  # fmt: skip
        return web.json_response({"object": "list", "data": data}, headers=self._server())

    async def props(self, request: web.Request) -> web.Response:
        """llama.cpp's `/props`: the window of one slot and the slots."""
        if not self.llama:
            raise web.HTTPNotFound()
        cfg = self.config
        body = {"default_generation_settings": {"n_ctx": cfg.context_window},
                "total_slots": max(1, cfg.max_concurrency),
                "model_alias": cfg.models[0]}  # fmt: skip
        return web.json_response(body, headers=self._server())

    def _server(self) -> dict[str, str]:
        return {"Server": "llama.cpp"} if self.llama else {}

    # -- chat ----------------------------------------------------------------
    def auth(self, request: web.Request, *, count: bool = True) -> web.Response | None:
        key = self.config.api_key
        if "deployment" in request.match_info:  # Azure's: its key in `api-key`
            if not request.query.get("api-version"):
                self._count(404, "azure_no_version")
                return _error(404, "Resource not found", "invalid_request_error", "404", {})
            if key and request.headers.get("api-key") != key:
                self._count(401, "auth")
                return _error(401, "Access denied due to invalid subscription key or wrong "
                              "API endpoint.", "invalid_request_error", "401", {})  # fmt: skip
            return None
        if key and request.headers.get("Authorization") != f"Bearer {key}":
            if count:
                self._count(401, "auth")
            if self.llama:
                body = {"error": {"message": "Invalid API Key", "type": "authentication_error",
                                  "code": 401}}  # fmt: skip
                return web.json_response(body, status=401, headers=self._server())
            return _error(
                401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key", {}
            )
        return None

    def _count(self, status: int, outcome: str) -> None:
        self.by_status[status] += 1
        self.by_outcome[outcome] += 1
        second = int(time.monotonic() - self.started)
        self.per_second.setdefault(second, Counter())[status] += 1
        if len(self.per_second) > 900:  # keep the last 15 minutes
            del self.per_second[min(self.per_second)]

    def _limit_headers(self) -> dict[str, str]:
        """The server's headers and, as OpenAI sends them, its limits (llama.cpp: none)."""
        headers = self._server()
        if self.llama or not self.config.rate_headers:
            return headers
        return {**headers, **self.limits.headers(self.config)}

    def _admit(self, tokens: int) -> tuple[float, str] | None:
        """Take capacity for one request, or say how long to wait and which limit hit."""
        limited = self.limits.admit(self.config, tokens)
        if limited is None:
            self.charged_tokens += tokens
        return limited

    async def _sleep_latency(self, factor: float = 1.0) -> None:
        cfg = self.config
        mean = cfg.latency_ms / 1000 * factor
        jitter = cfg.latency_jitter_ms / 1000 * factor
        if cfg.latency_dist == "fixed" or jitter <= 0:
            delay = mean
        elif cfg.latency_dist == "normal":
            delay = self.rng.gauss(mean, jitter)
        elif cfg.latency_dist == "lognormal" and mean > 0:
            sigma = math.sqrt(math.log(1 + (jitter / mean) ** 2))
            delay = self.rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)
        else:
            delay = self.rng.uniform(mean - jitter, mean + jitter)
        if delay > 0:
            await asyncio.sleep(delay)

    def _semaphore(self) -> asyncio.Semaphore | None:
        size = self.config.max_concurrency
        if size <= 0:
            return None
        if self._sem is None or self._sem_size != size:
            self._sem = asyncio.Semaphore(size)
            self._sem_size = size
        return self._sem

    async def chat(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        if (denied := self.auth(request)) is not None:
            return denied
        try:
            body = orjson.loads(await request.read())
            messages = body["messages"]
            # Azure serves the deployment of its path, whatever the body's model says.
            model = str(request.match_info.get("deployment") or body["model"])
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            self._count(400, "bad_request")
            return _error(
                400, f"Invalid request: {exc}", "invalid_request_error", "invalid_request", {}
            )
        if self.config.models_only and model not in self.config.models:
            self._count(404, "model_not_found")
            return _error(404, f"The model `{model}` does not exist or you do not have access "
                          "to it.", "invalid_request_error", "model_not_found", {})  # fmt: skip
        self.chats.append(messages)
        sem = self._semaphore()
        if sem is None:
            return await self._answer(body, messages, model, arrived)
        async with sem:
            return await self._answer(body, messages, model, arrived)

    async def _answer(
        self, body: dict[str, Any], messages: list[dict[str, Any]], model: str, arrived: float
    ) -> web.Response:
        cfg = self.config
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt_tokens = count_messages(messages)
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
            flex = body.get("service_tier") == "flex" and not self.llama  # llama.cpp: ignored
            refused, headers = self._refused(body, model, prompt_tokens, max_tokens, flex)
            if refused is not None:
                return refused
            began = time.monotonic()
            await self._sleep_latency(cfg.flex_latency_factor if flex else 1.0)
            worked_ms = (time.monotonic() - began) * 1000
            roll = self.rng.random()
            failed = await self._fault(roll, model, headers)
            if failed is not None:
                return failed
            roll -= cfg.hang_rate + cfg.error_500_rate + cfg.error_503_rate
            content, finish_reason, completion_tokens = self._content_within(
                body, messages, max_tokens, malformed=0 <= roll < self._malformed_rate(messages)
            )
            self._remember(orjson.dumps([model, messages]))
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self._count(200, "ok_flex" if flex else "ok")
            usage = (prompt_tokens, completion_tokens, self._cached(messages))
            payload = self._completion(body, model, content, finish_reason, flex, usage,
                                       worked_ms)  # fmt: skip
            answer = orjson.dumps(payload)
            spent_ms = (time.monotonic() - arrived) * 1000
            self.service_ms.append(spent_ms)
            if not self.llama:  # as OpenAI says its own time on every answer
                headers["openai-processing-ms"] = str(round(spent_ms))
            return web.Response(body=answer, content_type="application/json", headers=headers)
        finally:
            self.in_flight -= 1

    def _refused(
        self, body: dict[str, Any], model: str, prompt_tokens: int, max_tokens: int, flex: bool
    ) -> tuple[web.Response | None, dict[str, str]]:
        """A refusal before any work (rate limited, json_schema unsupported, over the
        window, no flex capacity), or None; and the answer's headers."""
        cfg = self.config
        limited = self._admit(prompt_tokens + max_tokens)
        headers = self._limit_headers()
        if limited is not None:
            wait, kind = limited
            headers["retry-after"] = str(max(1, math.ceil(wait)))
            headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
            self._count(429, f"rate_limited_{kind}")
            limit = cfg.rpm if kind == "requests" else cfg.tpm
            asked = 1 if kind == "requests" else prompt_tokens + max_tokens
            words = refusal(kind, limit, asked, wait, model, cfg.header_style, cfg.rate_headers)
            return _error(429, *words, headers), headers
        if model in cfg.reasoning_models:
            unsupported = _unsupported_param(body)
            if unsupported is not None:
                self._count(400, "param_unsupported")
                return _error(400, unsupported[1], "invalid_request_error", unsupported[0],
                              headers), headers  # fmt: skip
        fmt = body.get("response_format") or {}
        if cfg.refuses_json_schema and fmt.get("type") == "json_schema":
            self._count(500, "json_schema_refused")
            return _error(500, "Unsupported response_format type: json_schema",
                          "server_error", None, headers), headers  # fmt: skip
        over = self._over_window(prompt_tokens, max_tokens, headers)
        if over is not None:
            return over, headers
        if flex and model in cfg.flex_refused_models:
            self._count(400, "flex_refused")
            return _error(400, "Unsupported service_tier: flex", "invalid_request_error", None,
                          headers), headers  # fmt: skip
        if flex and self.rng.random() < cfg.flex_unavailable_rate:
            self._count(429, "flex_unavailable")
            return _error(429, "Resource unavailable: flex processing has no capacity right now.",
                          "server_error", "resource_unavailable", headers), headers  # fmt: skip
        return None, headers

    async def _fault(self, roll: float, model: str, headers: dict[str, str]) -> web.Response | None:
        """The fault `roll` falls on, after the work: a hang (then the answer), a 500 or
        a 503; None: no fault."""
        cfg = self.config
        if roll < cfg.hang_rate:
            self.by_outcome["hang"] += 1
            await asyncio.sleep(cfg.hang_s)
        roll -= cfg.hang_rate
        if 0 <= roll < cfg.error_500_rate or model in cfg.error_500_models:
            self._count(500, "error_500")
            return _error(500, "The server had an error while processing your request.",
                          "server_error", None, headers)  # fmt: skip
        roll -= cfg.error_500_rate
        if 0 <= roll < cfg.error_503_rate:
            self._count(503, "error_503")
            if cfg.error_503_retry_after_s:  # when to come back, as RFC 9110 lets a 503 say
                headers = {**headers, "retry-after": f"{cfg.error_503_retry_after_s:g}"}
            return _error(503, "The engine is currently overloaded, please try again later.",
                          "server_error", None, headers)  # fmt: skip
        return None

    def _content_within(
        self, body: dict[str, Any], messages: list[dict[str, Any]], max_tokens: int,
        *, malformed: bool,
    ) -> tuple[str, str, int]:  # fmt: skip
        """The answer's content (cut in half when `malformed`), cut at the budget as models
        do; its finish reason and its tokens."""
        content = self._content(body, messages)
        if self.config.reasoning_in_content:
            content = REASONING + content
        if malformed:
            content = content[: max(1, len(content) // 2)]
            self.by_outcome["malformed"] += 1
        completion_tokens = self.count_tokens(content)
        if completion_tokens <= max_tokens:
            return content, "stop", completion_tokens
        self.by_outcome["truncated"] += 1
        cut = content[: max(1, len(content) * max_tokens // completion_tokens)]
        return cut, "length", max_tokens

    def _cached(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of the first message read from the prompt cache (0: a miss or no cache)."""
        least = self.config.prompt_cache_min_tokens
        if least is None or not messages:
            return 0
        first = str(messages[0].get("content") or "")
        key = hashlib.sha256(first.encode()).hexdigest()
        seen = key in self.cached_prefixes
        tokens = self.cached_prefixes.get(key) or self.count_tokens(first)
        self.cached_prefixes[key] = tokens
        self.cached_prefixes.move_to_end(key)
        while len(self.cached_prefixes) > 1000:
            self.cached_prefixes.popitem(last=False)
        return tokens if seen and tokens >= least else 0

    def _completion(
        self,
        body: dict[str, Any],
        model: str,
        content: str,
        finish_reason: str,
        flex: bool,
        usage: tuple[int, int, int],
        worked_ms: float,
    ) -> dict[str, Any]:
        """The chat completion body, as the server played answers it (`usage`: prompt,
        completion and cached prompt tokens)."""
        prompt_tokens, completion_tokens, cached = usage
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        tool = forced_tool(body) if not self.llama else None  # llama.cpp: as content
        if tool is not None:  # the answer as the function's arguments
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": tool.get("name"), "arguments": content}}  # fmt: skip
            message.update(content=None, tool_calls=[call])
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        payload = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "service_tier": "flex" if flex else "default",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        if cached:
            payload["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[index]
        if self.config.usage == "none":
            del payload["usage"]
        elif self.config.usage == "zeros":
            payload["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        if self.llama:
            del payload["service_tier"]  # never echoed
            share = prompt_tokens / 8 / (prompt_tokens / 8 + completion_tokens + 1)
            payload["timings"] = {"prompt_n": prompt_tokens, "predicted_n": completion_tokens,
                                  "prompt_ms": worked_ms * share,
                                  "predicted_ms": worked_ms * (1 - share)}  # fmt: skip
        return payload

    def _over_window(
        self, prompt_tokens: int, max_tokens: int, headers: dict[str, str]
    ) -> web.Response | None:
        """The refusal of a prompt over the window, in the shape of the server played."""
        cfg = self.config
        if self.llama and prompt_tokens > cfg.context_window:
            self._count(400, "context_overflow")
            error = {"code": 400, "message": f"request ({prompt_tokens} tokens) exceeds the "
                     f"available context size ({cfg.context_window} tokens), try increasing "
                     "it", "type": "exceed_context_size_error",
                     "n_prompt_tokens": prompt_tokens, "n_ctx": cfg.context_window}  # fmt: skip
            return web.json_response({"error": error}, status=400, headers=headers)
        if not self.llama and prompt_tokens + max_tokens > cfg.context_window:
            self._count(400, "context_overflow")
            return _error(
                400,
                f"This model's maximum context length is {cfg.context_window} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion).",
                "invalid_request_error",
                "context_length_exceeded",
                headers,
            )
        return None

    def _malformed_rate(self, messages: list[dict[str, Any]]) -> float:
        """`malformed_rate`, or the rate of a `malformed_if_prompt_has` marker the
        messages contain."""
        cfg = self.config
        rate = cfg.malformed_rate
        if cfg.malformed_if_prompt_has:
            said = orjson.dumps(messages).decode()
            for marker, marked in cfg.malformed_if_prompt_has.items():
                if marker in said:
                    rate = marked
        return rate

    def _content(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> str:
        packed = self._packed_content(body, messages)
        if packed is not None:
            return packed
        text = sim_content.comment_text(messages)
        tool = forced_tool(body)
        if tool is not None and self.llama:  # the forced call refused: JSON text, fenced
            answer = sim_content.instance(tool.get("parameters") or {}, text)
            return "```json\n" + orjson.dumps(answer).decode() + "\n```"
        asked = tool.get("parameters") if tool is not None else schema_in_prompt(messages)
        if isinstance(asked, dict):
            return orjson.dumps(sim_content.instance(asked, text)).decode()
        fmt = body.get("response_format") or {}
        if self.config.ignores_response_format:
            return str(sim_content.analysis(text)["summary"])
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") or {}
            answer = sim_content.instance(schema, text)
            model = body.get("model")
            long = self.config.long_answer_chars and model in self.config.long_answer_models
            if long and isinstance(answer, dict):
                answer = sim_content.padded(answer, self.config.long_answer_chars)
            cfg = self.config
            if isinstance(answer, dict) and cfg.shift_fields and self.rng.random() < cfg.shift_rate:
                answer = {**answer, **{k: v for k, v in cfg.shift_fields.items() if k in answer}}
            return orjson.dumps(answer).decode()
        if fmt.get("type") == "json_object":
            return orjson.dumps(sim_content.analysis(text)).decode()
        return str(sim_content.analysis(text)["summary"])

    def _packed_content(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> str | None:
        """A packed request's answer: each item answered as alone, in an order of its own
        (answers are matched by id), less the items the config drops or breaks."""
        user = [m for m in messages if m.get("role") == "user"]
        items = _ITEM.findall(str(user[-1].get("content", ""))) if user else []
        if not items:
            return None
        fmt = body.get("response_format") or {}
        tool = forced_tool(body)
        root = (
            tool.get("parameters")
            if tool is not None
            else (fmt.get("json_schema") or {}).get("schema")
            if fmt.get("type") == "json_schema"
            else None
        )
        answers = []
        for item_id, text in items:
            comment = sim_content.comment_text([{"role": "user", "content": text}])
            if isinstance(root, dict):
                answer_schema = root["properties"]["answers"]["items"]["properties"]["answer"]
                answer = sim_content.instance_at(root, answer_schema, comment)
            else:
                answer = sim_content.analysis(comment)
            answers.append({"id": item_id, "answer": answer})
        order = sorted(answers, key=lambda a: hashlib.sha256(a["id"].encode()).digest())
        cfg = self.config
        dropped = order[: cfg.packed_drop_items]
        broken = order[cfg.packed_drop_items : cfg.packed_drop_items + cfg.packed_invalid_items]
        for entry in broken:
            entry["answer"] = {"sentiment": "unknowable"}
        self.by_outcome["packed_items"] += len(items)
        return orjson.dumps({"answers": [a for a in order if a not in dropped]}).decode()


def forced_tool(body: dict[str, Any]) -> dict[str, Any] | None:
    """The function a request forces the answer to call, if it does."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    name = (choice.get("function") or {}).get("name")
    for tool in body.get("tools") or []:
        function = tool.get("function") or {}
        if tool.get("type") == "function" and function.get("name") == name:
            return dict(function)
    return None


def schema_in_prompt(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JSON Schema a system message asks the answer to follow (`schema_in_prompt`)."""
    for m in messages:
        content = str(m.get("content") or "")
        if m.get("role") == "system" and SCHEMA_IN_PROMPT in content:
            try:
                schema = orjson.loads(content.split(SCHEMA_IN_PROMPT, 1)[1].strip())
            except orjson.JSONDecodeError:
                return None
            return schema if isinstance(schema, dict) else None
    return None


_ITEM = re.compile(r'<item id="([^"]*)">\n?(.*?)\n?</item>', re.S)


class SimulatorServer:
    """Runs a Simulator on a loopback port inside the current event loop."""

    def __init__(
        self, config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.sim = Simulator(config)
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> SimulatorServer:
        self._runner = web.AppRunner(
            self.sim.app, access_log=None, handle_signals=False, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server  # noqa: SLF001  # aiohttp: the bound socket tells the port used
        if server is not None and self.port == 0:
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> SimulatorServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def serve(config: SimConfig, host: str, port: int) -> None:
    """Run the simulator in the foreground until interrupted."""
    # Its started heap out of the garbage collector's full passes, as the worker's
    # (streams.worker.run.freeze_started_heap): a 30-50 ms pause here is a call answered
    # that much late, which the benchmarks would bill to the worker.
    gc.collect()
    gc.freeze()
    web.run_app(Simulator(config).app, host=host, port=port, access_log=None, print=None)
