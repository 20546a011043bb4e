"""Helpers shared by the local brokers."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float, alive: object = None) -> None:
    """Block until a TCP connect to host:port succeeds; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if callable(alive) and not alive():
            raise RuntimeError(f"broker process exited before {host}:{port} answered")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} did not answer within {timeout_s:g}s") from None
            time.sleep(0.1)
