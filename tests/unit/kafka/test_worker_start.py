"""What the worker refuses before it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from streams.dev.brokers.tansu import TansuBroker


def test_exactly_once_on_a_broker_without_transactions_is_refused_clearly(
    tmp_path: Path,
) -> None:
    with TansuBroker(log_file=tmp_path / "tansu.log") as broker:  # no transactions
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "LLM_STREAMS_PROCESSING_GUARANTEE": "exactly_once",
               "LLM_STREAMS_KAFKA__BROKER_URL": broker.url,
               "LLM_STREAMS_DATA_DIR": str(tmp_path)}  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "streams.cli", "worker"], env=env,
                              capture_output=True, timeout=90, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "exactly_once needs a Kafka broker with transactions" in done.stderr
    assert "at_least_once" in done.stderr
