"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from streams.dev.simulator import SimConfig, SimulatorServer
from tests.prerequisites import missing


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stop before the first test when the machine lacks what the selected tests need."""
    needed = missing(
        kafka=any(item.get_closest_marker("integration") for item in items),
        chromium=any(item.get_closest_marker("browser") for item in items),
    )
    if needed:
        raise pytest.UsageError(
            "the selected tests need, and this machine lacks:\n  - "
            + "\n  - ".join(needed)
            + "\nInstall them (README.md lists every requirement) and run the tests again."
        )


@pytest.fixture
async def simulator() -> AsyncIterator[SimulatorServer]:
    """An LLM simulator on a free loopback port; change `simulator.sim.config` per test."""
    server = SimulatorServer(SimConfig())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
