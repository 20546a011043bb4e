"""A prompt over the model's context window, as every known server says it.

Each OpenAI-compatible server words the refusal its own way, and most say the numbers
that matter — the window and the prompt's size — somewhere in it. One table of the
shapes seen (and where each says its numbers) makes any of them a `ContextOverflow`
carrying those numbers, so the pipeline's `on_context_overflow` strategy runs and the
window is learned, instead of a `bad_request` dead letter that nothing redrives:

Shapes seen (status; where the window N and the prompt's tokens P are said):

- OpenAI, Azure OpenAI, Groq (400): `code: context_length_exceeded`, "This model's
  maximum context length is N tokens. However, you requested M tokens (P in the
  messages, C in the completion)".
- llama.cpp server (400; 500 before mid-2025): `type: exceed_context_size_error` with
  `n_ctx` and `n_prompt_tokens`, "request (P tokens) exceeds the available context
  size (N tokens)".
- vLLM (400): "This model's maximum context length is N tokens and your request has P
  input tokens", or "The decoder prompt (length P) is longer than the maximum model
  length of N".
- Ollama (400/500): "the input length exceeds the context length" (its OpenAI endpoint
  truncates at `num_ctx` instead, unless told otherwise).
- LiteLLM proxy (400): "litellm.ContextWindowExceededError: ..." around the upstream's.
- Hugging Face TGI (422): "`inputs` tokens + `max_new_tokens` must be <= N. Given: P
  `inputs` tokens and C `max_new_tokens`".
- Anthropic through a gateway (400): "prompt is too long: P tokens > N maximum".
- Mistral (400): "Prompt contains P tokens and C draft tokens, too large for model with
  N maximum context length".
- Gemini's OpenAI endpoint (400): "The input token count (P) exceeds the maximum number
  of tokens allowed (N)".
"""

from __future__ import annotations

import re
from typing import Any

from streams.errors import ContextOverflow
from streams.llm.error_body import error_object

CODES = frozenset({"context_length_exceeded", "exceed_context_size_error",
                   "context_window_exceeded"})  # fmt: skip
# Words that say "over the window" (any of them, case-insensitive).
_SAYS = re.compile(
    r"maximum context length|context size|context length|context window|"
    r"contextwindowexceeded|prompt is too long|maximum model length|"
    r"`inputs` tokens \+ `max_new_tokens`|maximum number of tokens allowed|"
    r"maximum context",
    re.IGNORECASE,
)
# Where each shape says the window, and the prompt's tokens (the first match wins).
_WINDOW = [re.compile(p, re.IGNORECASE) for p in (
    r"maximum context length is (\d+)",
    r"available context size \((\d+) tokens?\)",
    r"maximum model length of (\d+)",
    r"must be <= (\d+)",
    r"with (\d+) maximum context length",
    r"maximum number of tokens allowed \((\d+)\)",
    r"tokens > (\d+) maximum",
    r"context (?:length|window|size) (?:is|of) (\d+)",
)]  # fmt: skip
_PROMPT = [re.compile(p, re.IGNORECASE) for p in (
    r"\((\d+) in the messages",
    r"request \((\d+) tokens?\)",
    r"your request has (\d+) input tokens",
    r"decoder prompt \(length (\d+)\)",
    r"given: (\d+) `inputs` tokens",
    r"prompt is too long: (\d+) tokens",
    r"prompt contains (\d+) tokens",
    r"input token count \((\d+)\)",
)]  # fmt: skip


def overflow_of(
    status: int, code: str | None, message: str, body: Any = None
) -> ContextOverflow | None:
    """The refusal as a ContextOverflow (with the window and prompt size when the server
    said them), or None when it is no overflow. `body`: the error's JSON body."""
    error = error_object(body)
    kind = str(error.get("type") or "")
    said = code in CODES or kind in CODES or bool(_SAYS.search(message))
    if not said or status in (401, 403, 429) or status < 400:
        return None
    window = _int(error.get("n_ctx")) or _first(_WINDOW, message)
    prompt_tokens = _int(error.get("n_prompt_tokens")) or _first(_PROMPT, message)
    return ContextOverflow(message, code="context_length_exceeded", window=window,
                           prompt_tokens=prompt_tokens)  # fmt: skip


def _first(patterns: list[re.Pattern[str]], text: str) -> int | None:
    for pattern in patterns:
        found = pattern.search(text)
        if found:
            return int(found.group(1))
    return None


def _int(value: Any) -> int | None:
    return (
        int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    )


__all__ = ["CODES", "overflow_of"]
