"""Inputs over the token budget: split on paragraph and sentence boundaries with
overlap, answer each chunk, merge the answers with the pipeline's reducers.

Chunks are cut from the slot's text as the prompt would show it (cleaned,
redacted, delimiters escaped), so a cut can never split personal data before
redaction saw it whole. A sentence longer than a chunk is cut by tokens.

Reducers, per output field (`chunking.reduce` in the pipeline file):
  vote        the value with the most weight (the `weight_field`, e.g.
              confidence, of each chunk's answer; 1 when absent); ties go to
              the earliest chunk
  majority    the most frequent value; ties go to the earliest chunk
  mean, min, max             numbers
  union       lists: every item of every chunk once (by value), in order,
              cut to the schema's maxItems
  first, last                the first / last chunk's value
  longest     the longest string
  join        strings joined with a space, cut to the schema's maxLength
  any, all    booleans
Fields without a reducer take the first chunk's value.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from streams.llm.tokens import counter, split_tokens

_PARAGRAPHS = re.compile(r"\n\s*\n")
# Between . ! ? and the blank after it, or after CJK sentence ends (no blank in Chinese);
# zero-width, so joining the pieces gives the text back.
_SENTENCES = re.compile(r"(?<=[.!?])(?=\s)|(?<=[。！？；])")


def _sentences(text: str) -> list[str]:
    out: list[str] = []
    for paragraph in _PARAGRAPHS.split(text):
        parts = [s for s in _SENTENCES.split(paragraph) if s.strip()]
        if parts:
            parts[-1] = parts[-1] + "\n\n"  # keep the paragraph break with its last sentence
            out.extend(parts)
    return out


def split_text(
    text: str, max_tokens: int, overlap_tokens: int, count: Callable[[str], int] | None = None
) -> list[str]:
    """Chunks of at most `max_tokens` tokens on sentence/paragraph boundaries; each
    after the first starts with up to `overlap_tokens` tokens of whole sentences from
    the end of the one before."""
    count = count or counter()
    units: list[tuple[str, int]] = []
    for sentence in _sentences(text):
        n = count(sentence)
        if n <= max_tokens:
            units.append((sentence, n))
        else:
            units.extend((piece, count(piece)) for piece in split_tokens(sentence, max_tokens))
    chunks: list[str] = []
    current: list[tuple[str, int]] = []
    size = 0
    fresh = 0  # units in `current` not carried over from the chunk before
    for unit in units:
        if current and size + unit[1] > max_tokens:
            chunks.append("".join(u for u, _ in current).strip())
            carried: list[tuple[str, int]] = []
            kept = 0
            for prev in reversed(current):
                if kept + prev[1] > overlap_tokens or kept + prev[1] + unit[1] > max_tokens:
                    break
                carried.insert(0, prev)
                kept += prev[1]
            current, size, fresh = carried, kept, 0
        current.append(unit)
        size += unit[1]
        fresh += 1
    if current and fresh:
        chunks.append("".join(u for u, _ in current).strip())
    return [c for c in chunks if c]


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _vote(values: list[Any], weights: list[float]) -> Any:
    totals: dict[bytes, float] = {}
    first: dict[bytes, Any] = {}
    for value, weight in zip(values, weights, strict=True):
        key = _canonical(value)
        totals[key] = totals.get(key, 0.0) + weight
        first.setdefault(key, value)
    best = max(totals.values())
    return next(first[k] for k in totals if totals[k] == best)  # earliest of the best


def _union(values: list[Any], schema: dict[str, Any]) -> list[Any]:
    seen: set[bytes] = set()
    out: list[Any] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            key = _canonical(item)
            if key not in seen:
                seen.add(key)
                out.append(item)
    limit = schema.get("maxItems")
    return out[:limit] if isinstance(limit, int) else out


def _join(values: list[Any], schema: dict[str, Any]) -> str:
    text = " ".join(str(v).strip() for v in values if str(v).strip())
    limit = schema.get("maxLength")
    return text[:limit].rstrip() if isinstance(limit, int) else text


# How each reducer merges one field's values (`weights` only for vote).
_REDUCE: dict[str, Callable[[list[Any], dict[str, Any], list[float]], Any]] = {
    "vote": lambda values, schema, weights: _vote(values, weights),
    "majority": lambda values, schema, weights: _vote(values, [1.0] * len(values)),
    "mean": lambda values, schema, weights: round(sum(values) / len(values), 6),
    "min": lambda values, schema, weights: min(values),
    "max": lambda values, schema, weights: max(values),
    "union": lambda values, schema, weights: _union(values, schema),
    "first": lambda values, schema, weights: values[0],
    "last": lambda values, schema, weights: values[-1],
    "longest": lambda values, schema, weights: max(values, key=lambda v: len(str(v))),
    "join": lambda values, schema, weights: _join(values, schema),
    "any": lambda values, schema, weights: any(values),
    "all": lambda values, schema, weights: all(values),
}


def reduce_outputs(
    outputs: list[dict[str, Any]],
    reducers: dict[str, str],
    schema: dict[str, Any],
    weight_field: str | None = None,
) -> dict[str, Any]:
    """One answer from the chunks' answers, field by field (`first` when the pipeline
    names no reducer for a field)."""
    props = schema.get("properties") or {}
    fields: list[str] = []
    for output in outputs:
        fields.extend(f for f in output if f not in fields)
    merged: dict[str, Any] = {}
    for name in fields:
        having = [o for o in outputs if name in o]
        field_schema = props.get(name)
        sub: dict[str, Any] = field_schema if isinstance(field_schema, dict) else {}
        weights = [
            float(o[weight_field])
            if weight_field and isinstance(o.get(weight_field), int | float)
            else 1.0
            for o in having
        ]
        reduce = _REDUCE[reducers.get(name, "first")]
        merged[name] = reduce([o[name] for o in having], sub, weights)
    return merged


__all__ = ["reduce_outputs", "split_text"]
