"""What the worker refuses before it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_exactly_once_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "LLM_STREAMS_PROCESSING_GUARANTEE": "exactly_once",
           "LLM_STREAMS_KAFKA__BROKER_URL": "kafka://127.0.0.1:1",
           "LLM_STREAMS_DATA_DIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "streams.cli", "worker"], env=env,
                          capture_output=True, timeout=60, text=True)  # fmt: skip
    assert done.returncode == 2
    assert "exactly_once is not available yet" in done.stderr
    assert "at_least_once" in done.stderr
