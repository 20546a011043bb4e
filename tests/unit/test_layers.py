"""The package's layers import downwards only, with no cycle, and each keeps its promise:
the core imports no Faust, Kafka client or HTTP library; the worker never imports the
development tooling; the contract imports nothing of ours but the error taxonomy."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "streams"

# What each part of the package may import (besides itself): the layers, bottom up.
ALLOWED = {
    "streams.errors": set(),
    "streams.settings": {"streams.errors"},
    "streams.preprocess": set(),
    "streams.contract": {"streams.errors"},
    "streams.llm": {"streams.errors", "streams.contract"},
    "streams.observability": {"streams.errors", "streams.settings", "streams.preprocess",
                              "streams.contract"},
    "streams.resilience": {"streams.errors", "streams.contract", "streams.llm",
                           "streams.observability"},
    "streams.schema_registry": {"streams.errors", "streams.settings", "streams.observability",
                                "streams.contract"},
    "streams.pipelines": {"streams.errors", "streams.llm", "streams.preprocess",
                          "streams.contract"},
    "streams.core": {"streams.errors", "streams.settings", "streams.contract", "streams.llm",
                     "streams.observability", "streams.resilience", "streams.pipelines"},
    # How the processor and the source reader are built: one place for worker and API.
    "streams.assembly": {"streams.errors", "streams.settings", "streams.contract", "streams.llm",
                         "streams.observability", "streams.resilience", "streams.pipelines",
                         "streams.core", "streams.schema_registry"},
    "streams.api": {"streams.errors", "streams.settings", "streams.contract", "streams.llm",
                    "streams.observability", "streams.resilience", "streams.pipelines",
                    "streams.core", "streams.assembly"},
    # Kafka plumbing every command uses: nothing of the core, the LLM or the worker.
    "streams.kafka": {"streams.errors", "streams.settings", "streams.contract",
                      "streams.observability"},
    "streams.store": {"streams.errors", "streams.settings", "streams.contract",
                      "streams.observability", "streams.resilience", "streams.pipelines",
                      "streams.core", "streams.kafka"},
    "streams.worker": {"streams.errors", "streams.settings", "streams.contract", "streams.llm",
                       "streams.observability", "streams.resilience", "streams.pipelines",
                       "streams.core", "streams.assembly", "streams.schema_registry",
                       "streams.kafka", "streams.store"},
    "streams.ops": {"streams.errors", "streams.settings", "streams.contract", "streams.llm",
                    "streams.pipelines", "streams.core", "streams.kafka", "streams.store"},
    # The simulated fleet (dev.fleet) runs the worker's own call path: resilience.
    "streams.dev": {"streams.errors", "streams.settings", "streams.llm", "streams.kafka",
                    "streams.ops", "streams.worker", "streams.resilience"},
    "streams.cli": {"streams.errors", "streams.settings", "streams.contract", "streams.kafka",
                    "streams.store", "streams.worker", "streams.ops", "streams.pipelines",
                    "streams.dev"},
    "streams.__main__": {"streams.worker"},
}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every `streams…` module a file imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("streams"):
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("streams"))
    return out


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_each_part_imports_only_the_layers_below_it() -> None:
    modules = _modules()
    wrong = []
    assert _imports(modules["streams"]) == set(), "the package root holds its version only"
    for name, path in modules.items():
        if name == "streams":
            continue
        part = _part(name)
        assert part in ALLOWED, f"{part} is a new part of the package: give it its layer here"
        for target in _imports(path):
            if target not in modules or target == "streams":
                continue  # a name imported from a module, or the package's version
            if _part(target) != part and _part(target) not in ALLOWED[part]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_module_import_cycle() -> None:
    modules = _modules()
    graph = {name: {t for t in _imports(path) if t in modules and t != name}
             for name, path in modules.items()}  # fmt: skip
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend([*path[path.index(nxt) :], nxt])
                return True
            if nxt not in state and visit(nxt, [*path, nxt]):
                return True
        state[node] = 2
        return False

    for start in sorted(graph):
        if start not in state and visit(start, [start]):
            break
    assert not cycle, " -> ".join(cycle)


def _loaded_by(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
                          capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    return set(done.stdout.split())


def test_the_core_imports_no_faust_kafka_client_or_http_library() -> None:
    loaded = _loaded_by(
        "import importlib, pkgutil, streams.core\n"
        "for m in pkgutil.iter_modules(streams.core.__path__):\n"
        "    importlib.import_module('streams.core.' + m.name)"
    )
    assert "streams.core.processor" in loaded
    forbidden = {"faust", "mode", "aiokafka", "openai", "httpx", "httpx2", "aiohttp"}
    assert not {m for m in loaded if m.split(".")[0] in forbidden}


def test_the_worker_never_imports_the_development_tooling() -> None:
    loaded = _loaded_by("import streams.worker.run, streams.worker.app, streams.__main__")
    assert "streams.worker.agent" in loaded
    assert not {m for m in loaded if m.startswith("streams.dev")}


def test_the_code_map_names_every_part_and_only_modules_that_exist() -> None:
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    modules = _modules()
    parts = {_part(m).removeprefix("streams.") for m in modules if m.count(".") >= 1}
    for part in parts - {"__main__"}:
        assert f"`{part}/`" in text or f"`{part}.py`" in text, f"{part} is missing from the map"
    named = set(re.findall(r"`((?:contract|llm|resilience|pipelines|core|kafka|store|worker|ops"
                           r"|observability|cli|dev)\.[a-z_]+)", text))  # fmt: skip
    assert named, "the map names no module"
    missing = sorted(n for n in named if f"streams.{n}" not in modules)
    assert not missing, f"the map names modules that do not exist: {missing}"
