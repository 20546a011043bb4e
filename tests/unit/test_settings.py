from __future__ import annotations

from pathlib import Path

import pytest

from streams.errors import ConfigError
from streams.settings import Settings, load_settings, setting_variables, settings_env


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
        # No deadline, price or timeout is infinite (an overflow at the start, a null cost).
        ("LLM_STREAMS_LLM__TASK_DEADLINE_S", "inf"),
        ("LLM_STREAMS_LLM__PRICE_PER_1K_PROMPT_USD", "Infinity"),
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


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("LLM_STREAMS_BATCHSIZE", "LLM_STREAMS_BATCH__SIZE"),
        ("LLM_STREAMS_BATCH_SIZE", "LLM_STREAMS_BATCH__SIZE"),
        ("LLM_STREAMS_KAKFA__BROKER_URL", "LLM_STREAMS_KAFKA__BROKER_URL"),
        ("LLM_STREAMS_LOGLEVEL", "LLM_STREAMS_LOG_LEVEL"),
    ],
)
def test_a_variable_that_is_no_setting_is_refused_with_the_nearest(
    monkeypatch: pytest.MonkeyPatch, typo: str, meant: str
) -> None:
    monkeypatch.setenv(typo, "5")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert f"{typo} is no setting (did you mean {meant}?)" in str(info.value)


def test_settings_and_tool_variables_are_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_STREAMS_KAFKA_JARS", "/x")  # the test suite's broker
    monkeypatch.setenv("LLM_STREAMS_SHUTDOWN_GRACE_S", "5")
    monkeypatch.setenv("LLM_STREAMS_KAFKA__SECURITY__PROTOCOL", "PLAINTEXT")
    assert load_settings().shutdown_grace_s == 5


def test_every_field_has_its_variable() -> None:
    names = setting_variables()
    assert "LLM_STREAMS_KAFKA__SECURITY__SASL_PASSWORD_FILE" in names
    assert "LLM_STREAMS_LLM__API_KEY_FILE" in names and "LLM_STREAMS_APP_ID" in names
    assert "LLM_STREAMS_KAFKA__SECURITY" not in names  # a section, not a field


@pytest.mark.parametrize("var", ["LLM_STREAMS_LLM__API_KEY_FILE", "OPENAI_API_KEY_FILE"])
def test_the_key_may_come_from_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str
) -> None:
    secret = tmp_path / "key"
    secret.write_text("sk-from-file\n")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    monkeypatch.setenv(var, str(secret))
    settings = load_settings()
    assert settings.llm.api_key is not None
    assert settings.llm.api_key.get_secret_value() == "sk-from-file"
    for name, value in settings_env(settings).items():  # a child process reads it again
        monkeypatch.setenv(name, value)
    assert load_settings() == settings


def test_an_unreadable_key_file_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLM_STREAMS_LLM__API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="LLM_STREAMS_LLM__API_KEY_FILE: cannot read"):
        load_settings()
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("LLM_STREAMS_LLM__API_KEY_FILE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="is empty"):
        load_settings()


def test_an_empty_endpoint_or_key_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose's `${OPENAI_BASE_URL:-}` gives "" when the user gave nothing."""
    monkeypatch.setenv("OPENAI_BASE_URL", "")
    monkeypatch.setenv("OPENAI_API_KEY", " ")
    monkeypatch.setenv("OPENAI_API_KEY_FILE", "")
    llm = load_settings().llm
    assert (llm.base_url, llm.api_key, llm.api_key_file) == (None, None, None)
