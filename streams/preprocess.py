"""Text cleaning and PII redaction, applied to every string slot before a prompt is rendered.

Cleaning: Unicode NFKC (full-width digits and letters, common in Chinese
comments, become ASCII, so the patterns below see them), control characters
dropped, runs of blanks squashed, three or more newlines cut to two.

Redaction replaces what it finds with a bracketed tag, so the model still sees
that something was there: e-mail addresses `[EMAIL]`; 18-digit Chinese resident
ID numbers with a province code, a real birth date and a valid check digit
`[ID_NUMBER]`; card numbers of 13-19 digits (spaces or dashes allowed) with a
card network's prefix that pass the Luhn check, unless an order/tracking word
names the number just before it `[BANK_CARD]`;
phone numbers `[PHONE]` — Chinese mobiles (optionally +86), numbers written
with a leading + and country code, and North American (xxx) xxx-xxxx forms;
and the pipeline's own patterns `[NAME]`. Digit runs that fail the checksums
(order numbers, tracking codes) are left alone.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import date

# Applied in this order: phones before cards, so "+86 138 1234 5678" is not read as a card.
KINDS = ("email", "cn_id", "phone", "bank_card")

# Its local part starts where a run of its characters starts (the same matches: a match
# inside a run extends to the run's start): tried at every position of a run, a long
# one without an @ (base64, a pasted hash) cost time in the square of its length —
# 19 s of the event loop for 160 KB.
_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
)
_CN_ID = re.compile(r"(?<![0-9A-Za-z])\d{17}[0-9Xx](?![0-9A-Za-z])")
# Not the fraction of a decimal number (0.4111111111111111 is a float, not a card), nor
# digits glued to letters (SF4111111111111111 is a waybill code).
_CARD = re.compile(r"(?<![A-Za-z\d-])(?<!\d[.,])\d(?:[ -]?\d){12,18}(?![\d-]|[.,]\d)")
_PHONE = re.compile(
    r"(?<![\d+])(?:\+?86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)"  # Chinese mobile
    # +CC …, also right after a Chinese character (which \w would count as a word one)
    r"|(?<![A-Za-z0-9_+])\+\d{1,3}[ -]?(?:\(\d{1,4}\)[ -]?)?\d{2,4}(?:[ -]?\d{2,4}){1,3}(?!\d)"
    r"|(?<!\d)(?:\(\d{3}\)\s?|\d{3}[-.])\d{3}[-.]\d{4}(?!\d)"  # (555) 123-4567, 555-123-4567
)
_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\ufeff]")
_BLANKS = re.compile(r"[ \t\u00a0\u3000]+")
_NEWLINES = re.compile(r"\n{3,}")


def clean(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = _BLANKS.sub(" ", text)
    return _NEWLINES.sub("\n\n", text).strip()


# First two digits of a resident ID: the province-level region.
_PROVINCES = frozenset(str(code) for code in (
    11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34, 35, 36, 37, 41, 42, 43, 44, 45, 46,
    50, 51, 52, 53, 54, 61, 62, 63, 64, 65, 71, 81, 82, 83, 91,
))  # fmt: skip
# Card networks' number prefixes (IIN): Visa, Mastercard, Amex, UnionPay, Discover,
# JCB, Diners, Maestro.
_CARD_PREFIX = re.compile(r"4|5[1-5]|2[2-7]|3[47]|62|60|65|64[4-9]|35|3[068]|5[06-9]|6[37]")
# A number introduced as an order, tracking or SKU number is that, whatever its digits.
_NOT_A_CARD = re.compile(
    r"(?:order|tracking|waybill|invoice|sku|ref(?:erence)?|no\.|#|订单|单号|运单|快递|物流|编号)"
    r"\s*(?:number|no\.?|id|num|号|号码)?\s*[:：#]?\s*$",
    re.IGNORECASE,
)


def valid_cn_id(candidate: str) -> bool:
    """Province code, a birth date that exists (1900 to this century) and the check digit."""
    if candidate[:2] not in _PROVINCES:
        return False
    try:
        born = date(int(candidate[6:10]), int(candidate[10:12]), int(candidate[12:14]))
    except ValueError:
        return False
    if not 1900 <= born.year <= 2099:
        return False
    digits = candidate[:17]
    total = sum(int(d) * w for d, w in zip(digits, _ID_WEIGHTS, strict=True))
    return _ID_CHECK[total % 11] == candidate[17].upper()


def luhn(number: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(number)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


class Redactor:
    """Finds and tags personal data; counts what it replaced, by kind."""

    def __init__(self, kinds: Iterable[str] = KINDS, extra: dict[str, str] | None = None) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown PII kinds {sorted(unknown)} (known: {list(KINDS)})")
        self.kinds = [k for k in KINDS if k in set(kinds)]
        self.extra = {name: re.compile(pattern) for name, pattern in (extra or {}).items()}

    def redact(self, text: str, counts: Counter[str]) -> str:
        for kind in self.kinds:
            text = _STEPS[kind](text, counts)
        for name, pattern in self.extra.items():
            text, n = pattern.subn(f"[{name.upper()}]", text)
            if n:
                counts[name] += n
        return text


def _sub_checked(
    pattern: re.Pattern[str], tag: str, kind: str, check: Callable[[re.Match[str]], bool]
) -> Callable[[str, Counter[str]], str]:
    def step(text: str, counts: Counter[str]) -> str:
        def replace(match: re.Match[str]) -> str:
            if not check(match):
                return match.group(0)
            counts[kind] += 1
            return tag

        return pattern.sub(replace, text)

    return step


def valid_card(raw: str) -> bool:
    """13-19 digits with a card network's prefix that pass the Luhn check."""
    digits = re.sub(r"[ -]", "", raw)
    return 13 <= len(digits) <= 19 and bool(_CARD_PREFIX.match(digits)) and luhn(digits)


def _card_ok(match: re.Match[str]) -> bool:
    before = match.string[max(0, match.start() - 24) : match.start()]
    return valid_card(match.group(0)) and not _NOT_A_CARD.search(before)


_STEPS: dict[str, Callable[[str, Counter[str]], str]] = {
    "email": _sub_checked(_EMAIL, "[EMAIL]", "email", lambda _: True),
    "cn_id": _sub_checked(_CN_ID, "[ID_NUMBER]", "cn_id", lambda m: valid_cn_id(m.group(0))),
    "bank_card": _sub_checked(_CARD, "[BANK_CARD]", "bank_card", _card_ok),
    "phone": _sub_checked(_PHONE, "[PHONE]", "phone", lambda _: True),
}

__all__ = ["KINDS", "Redactor", "clean", "luhn", "valid_card", "valid_cn_id"]
