"""`pipelines validate --endpoint`'s report of one endpoint and model (`ops.endpoint`)."""

from __future__ import annotations

from typing import Any

from streams.llm.endpoint import EndpointFacts
from streams.ops.endpoint import _describe


class LoadsOnDemand:
    """An endpoint that loads a model at its first call and says its window only then
    (Ollama's `/api/ps`)."""

    def __init__(self) -> None:
        self.called = False

    async def describe(self, model: str) -> EndpointFacts:
        if not self.called:
            return EndpointFacts(server="ollama", unloaded=True)
        return EndpointFacts(server="ollama", context_window=4096)

    async def structured_support(self, model: str) -> dict[str, str]:
        self.called = True
        return {"json_schema": "honoured"}


async def test_a_model_loaded_by_the_tries_has_its_window_reported() -> None:
    """The report asked before its tries loaded the model: 'window not said' for a model
    Ollama cuts at 4,096 tokens."""
    lines: list[str] = []
    client: Any = LoadsOnDemand()
    await _describe(lines, "endpoint http://ollama:11434/v1 model qwen2.5", client, "qwen2.5")
    assert lines == [
        "endpoint http://ollama:11434/v1 model qwen2.5: server ollama, window 4096, slots not said",
        "  json_schema: honoured",
    ]
