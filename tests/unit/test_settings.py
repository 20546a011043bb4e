from __future__ import annotations

import pytest

from streams.errors import ConfigError
from streams.settings import Settings, load_settings, settings_env


def test_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_STREAMS_BATCH__SIZE", "7")
    monkeypatch.setenv("LLM_STREAMS_TOPICS__RESULTS", "out")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
    s = load_settings()
    assert s.batch.size == 7 and s.topics.results == "out"
    assert s.llm.api_key is not None and s.llm.api_key.get_secret_value() == "sk-test"
    assert s.llm.base_url == "http://127.0.0.1:1/v1"
    assert s.batch.concurrency == 64  # separate from batch size


def test_own_variables_win_over_openai_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    monkeypatch.setenv("LLM_STREAMS_LLM__API_KEY", "sk-ours")
    key = load_settings().llm.api_key
    assert key is not None and key.get_secret_value() == "sk-ours"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("LLM_STREAMS_BATCH__SIZE", "0"),
        ("LLM_STREAMS_BATCH__CONCURRENCY", "many"),
        ("LLM_STREAMS_STORE", "redis://x"),
        ("LLM_STREAMS_PROCESSING_GUARANTEE", "maybe_once"),
        ("LLM_STREAMS_KAFKA__BROKER_URL", "kafka://nohostport"),
        ("LLM_STREAMS_LOG_LEVEL", "loud"),
    ],
)
def test_invalid_setting_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert var in str(info.value)


def test_settings_env_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    original = load_settings(
        batch={"size": 3}, llm={"api_key": "k", "model": "m"}, store="rocksdb://"
    )
    for var, value in settings_env(original).items():
        monkeypatch.setenv(var, value)
    assert load_settings() == original
    assert isinstance(original, Settings)
