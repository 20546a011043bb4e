"""Resilience: the retry policy (the only retry owner; SDK retries are off)."""

from streams.resilience.retry import RetryPolicy, call_with_retries

__all__ = ["RetryPolicy", "call_with_retries"]
