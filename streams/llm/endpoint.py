"""What an endpoint is, learned instead of assumed: its server, the model's context
window, how many requests it answers at once — from what the server says of itself,
and from what its answers and refusals show.

Servers other than OpenAI's say these things, each in its own place:

- llama.cpp's server: `GET /props` (`default_generation_settings.n_ctx`: the window of
  one slot, `total_slots`) and `GET /v1/models` (`data[].meta.n_ctx`);
- vLLM: `GET /v1/models` (`data[].max_model_len`);
- OpenRouter, Together, Fireworks, Groq, LM Studio: `GET /v1/models`
  (`context_length`, `context_window` or `max_context_length`);
- Ollama: `GET /api/ps` (a loaded model's `context_length`: the window it was given, by
  its `num_ctx`, OLLAMA_CONTEXT_LENGTH or the server's memory — 4,096 tokens under 24 GiB
  of VRAM, whatever the model was trained for), else `POST /api/show` (`parameters` holds
  `num_ctx` when the model sets one). Its OpenAI endpoint cuts a longer prompt silently,
  which nothing else tells; a model it loads only at its first call (`unloaded`) is asked
  about again once it has answered (`resilience.guarded`).

OpenAI's own model list says none of them: its windows stay at the default until an
overflow error says the number (`llm.overflow`).

`ContextWindow` is what a guarded client keeps of one endpoint and model: the window in
the server's tokens (a setting, or told, or learned from an overflow), and how the
server counts tokens against the project's offline tokenizer — a 0.5B model's
tokenizer counted a Chinese comment at 4,510 tokens where o200k counts 5,610 — so that
prompts are fitted to the window as the server will count them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# A window nobody told: large enough for every hosted model, until an overflow says more.
DEFAULT_WINDOW = 128_000
# The server's tokens per one of ours stays within these: a count of one prompt is noisy,
# and a server that counts fewer than we do leaves a margin, never an overflow.
RATIO_BOUNDS = (1.0, 4.0)
_WINDOW_KEYS = ("max_model_len", "context_length", "context_window", "max_context_length")
_NUM_CTX = re.compile(r"(?m)^\s*num_ctx\s+(\d+)")


@dataclass(frozen=True)
class EndpointFacts:
    """What an endpoint said of itself (None: it did not say)."""

    server: str | None = None  # "llama.cpp", "vllm", "ollama", or None
    context_window: int | None = None  # one request's window, in the server's tokens
    slots: int | None = None  # requests it works on at once (llama.cpp's slots)
    models: tuple[str, ...] = ()
    # A server that loads a model at its first call (Ollama) had not loaded this one: what
    # it gives the model is said once it has answered.
    unloaded: bool = False


def facts_from(
    model: str,
    models: Any = None,
    props: Any = None,
    show: Any = None,
    server: str | None = None,
    running: Any = None,
) -> EndpointFacts:
    """The facts in the bodies of `GET /v1/models`, llama.cpp's `GET /props` and Ollama's
    `POST /api/show` and `GET /api/ps` (`running`) (each None when the server has no such
    route); `server`: what its `Server` header said."""
    listed = models.get("data") if isinstance(models, Mapping) else None
    entries = [e for e in listed if isinstance(e, Mapping)] if isinstance(listed, list) else []
    ids = tuple(str(e.get("id")) for e in entries if e.get("id"))
    entry = next((e for e in entries if e.get("id") == model), None)
    if entry is None and len(entries) == 1:
        entry = entries[0]  # a server of one model answers under any name (llama.cpp)
    window = _window_of(entry) if entry is not None else None
    slots = None
    if isinstance(props, Mapping):
        server = server or "llama.cpp"
        settings = props.get("default_generation_settings")
        if isinstance(settings, Mapping):
            window = _positive(settings.get("n_ctx")) or window
        slots = _positive(props.get("total_slots"))
    unloaded = False
    if isinstance(show, Mapping):
        server = server or "ollama"
        found = _NUM_CTX.search(str(show.get("parameters") or ""))
        loaded = _loaded_window(model, running)
        window = loaded or (int(found.group(1)) if found else window)
        unloaded = loaded is None
    if entry is not None and server is None:
        owned = str(entry.get("owned_by") or "")
        server = "vllm" if owned == "vllm" else "llama.cpp" if owned == "llamacpp" else None
    return EndpointFacts(server=server, context_window=window, slots=slots, models=ids,
                         unloaded=unloaded)  # fmt: skip


def _window_of(entry: Mapping[str, Any]) -> int | None:
    meta = entry.get("meta")
    if isinstance(meta, Mapping) and _positive(meta.get("n_ctx")):
        return _positive(meta.get("n_ctx"))
    for key in _WINDOW_KEYS:
        found = _positive(entry.get(key))
        if found:
            return found
    return None


def _loaded_window(model: str, running: Any) -> int | None:
    """The window Ollama gave `model`, when it is loaded: its entry in `GET /api/ps`, named
    as the worker names it or with the `:latest` tag Ollama adds to a name without one."""
    listed = running.get("models") if isinstance(running, Mapping) else None
    if not isinstance(listed, list):
        return None
    wanted = {model, model if ":" in model else f"{model}:latest"}
    for entry in listed:
        if isinstance(entry, Mapping) and any(
            isinstance(name, str) and name in wanted
            for name in (entry.get("name"), entry.get("model"))
        ):
            return _positive(entry.get("context_length"))
    return None


def _positive(value: Any) -> int | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return int(value) if ok else None


class ContextWindow:
    """One endpoint and model's window, and how its server counts tokens against ours.

    `configured` (LLM_STREAMS_LLM__CONTEXT_WINDOW) wins over anything told or learned."""

    def __init__(self, configured: int | None = None, name: str = "") -> None:
        self.configured = configured
        self.name = name
        self.told: int | None = None  # by the server, at start
        self.learned: int | None = None  # from an overflow error
        self.ratio = 1.0  # the server's tokens per one of ours
        self.samples = 0  # prompts compared
        self.answers = 0  # answers seen

    @property
    def server_tokens(self) -> int:
        """The window as the server counts it."""
        return self.configured or self.learned or self.told or DEFAULT_WINDOW

    @property
    def source(self) -> str:
        if self.configured:
            return "setting"
        return "overflow" if self.learned else "endpoint" if self.told else "default"

    def tokens(self) -> int:
        """The window in the project's tokens (what prompts are counted in)."""
        return max(1, int(self.server_tokens / self.ratio))

    def tell(self, window: int | None) -> None:
        if window and window != self.told:
            self.told = window
            if not self.configured:
                log.info("%s: context window %d tokens, as the endpoint says", self.name, window)

    def overflowed(self, window: int | None, theirs: int | None, ours: int) -> None:
        """An overflow error said the window (and the prompt's size, in its tokens)."""
        if theirs and ours:
            self.count(theirs, ours, weight=0.5)
        if window and window != self.learned:
            self.learned = window
            if not self.configured:
                log.warning("%s: context window %d tokens, as its overflow error says (the "
                            "worker assumed %d)", self.name, window,
                            self.told or DEFAULT_WINDOW)  # fmt: skip

    def wants_sample(self) -> bool:
        """Whether to count this answer's prompt to compare with the server's count: the
        first few answers, then one in fifty (counting costs CPU)."""
        self.answers += 1
        return self.answers <= 8 or self.answers % 50 == 0

    def count(self, theirs: int, ours: int, weight: float = 0.2) -> None:
        """One prompt counted by the server (`theirs`) and by us."""
        self.samples += 1
        if theirs <= 0 or ours <= 0:
            return
        low, high = RATIO_BOUNDS
        sample = min(high, max(low, theirs / ours))
        self.ratio = sample if self.samples == 1 else self.ratio + (sample - self.ratio) * weight


__all__ = ["DEFAULT_WINDOW", "ContextWindow", "EndpointFacts", "facts_from"]
