"""The numbers a provider's headers say: limits, what is left, when to come back."""

from __future__ import annotations

import pytest

from streams.llm.ratelimit_headers import delay, number, seconds

NOW = 1_796_468_400.0  # Sat, 05 Dec 2026 11:00:00 GMT


@pytest.mark.parametrize(
    ("said", "found"),
    [("600", 600.0), ("1.5", 1.5), ("-3", 0.0), ("nan", None), ("inf", None), ("1e999", None),
     ("many", None), (None, None)],
)  # fmt: skip
def test_a_number_is_finite_and_at_least_zero(said: str | None, found: float | None) -> None:
    assert number(said) == found


@pytest.mark.parametrize(
    ("said", "found"),
    [("6m0s", 360.0), ("1.5s", 1.5), ("20ms", 0.02), ("1h", 3600.0), ("12", 12.0), ("soon", None)],
)
def test_a_reset_in_openais_duration_form_or_in_seconds(said: str, found: float | None) -> None:
    assert seconds(said) == found


@pytest.mark.parametrize(
    ("said", "found"),
    [
        ("30", 30.0),
        ("Sat, 05 Dec 2026 11:00:30 GMT", 30.0),  # RFC 9110: an HTTP date
        ("Sat, 05 Dec 2026 10:59:00 GMT", 0.0),  # passed: at once
        ("Sat, 05 Dec 2026 11:00:30", None),  # no zone: no telling when
        ("tomorrow", None),
        ("", None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(said: str, found: float | None) -> None:
    assert delay(said, now=NOW) == found
