"""README is the way in: short, its walk-through true (the pipeline file loads and maps
the example record, the .env names real settings), its links to pages that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dotenv import dotenv_values

from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sources import Skipped
from streams.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
WALK = README[README.index("## Your topic, your key") : README.index("## Where to read next")]


def _block(lang: str, text: str = WALK) -> str:
    (found,) = re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)[:1]
    return found


def test_readme_stays_a_way_in() -> None:
    assert len(README.encode()) < 15_000
    assert README.index("make run") < README.index("## Your topic, your key")


def test_every_page_it_links_exists() -> None:
    for target in re.findall(r"\]\(([^)#]+)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), (page.name, target)


def test_the_walk_through_pipeline_loads_and_maps_the_example_record(tmp_path: Path) -> None:
    (tmp_path / "reviews.yaml").write_text(_block("yaml"))
    registry = PipelineRegistry.load(tmp_path, ROOT / "schemas")
    ((topic, (mapper,)),) = registry.sources().items()
    assert topic == "shop.reviews"
    record = re.search(r"`(\{\"review_id\".*?\})`", WALK)
    assert record is not None
    task = mapper.task(record.group(1).encode(), b"r-1")
    assert not isinstance(task, Skipped)
    assert task["task_id"] == "r-1" and task["pipeline"] == "reviews"
    assert task["input"] == {"text": "Arrived broken, nobody answers.", "rating": "1"}
    assert isinstance(mapper.task(b'{"review_id": "r-2", "stars": 5}', b"r-2"), Skipped)
    prompt = registry.get("reviews").version(None).render(task["input"], "gpt-4o-mini")
    assert "Arrived broken" in prompt.messages[-1]["content"]


def test_the_walk_through_env_names_real_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tmp_path / ".env"
    env.write_text(_block("bash"))
    values = {k: v for k, v in dotenv_values(env).items() if v is not None}
    assert {"LLM_STREAMS_KAFKA__BROKER_URL", "OPENAI_API_KEY"} <= set(values)
    for name in list(values):
        monkeypatch.setenv(name, values[name])
    settings = load_settings()  # refuses a variable that is no setting
    assert settings.bootstrap_servers == "broker-1:9092"
    assert settings.pipelines_dir == Path("my-pipelines")
