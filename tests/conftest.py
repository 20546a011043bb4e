"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from streams.llm.simulator import SimConfig, SimulatorServer


@pytest.fixture
async def simulator() -> AsyncIterator[SimulatorServer]:
    """An LLM simulator on a free loopback port; change `simulator.sim.config` per test."""
    server = SimulatorServer(SimConfig())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
