"""The security configuration: one place builds every client's, a wrong or missing value
is refused naming the setting (and never showing a secret), secrets come from files."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import faust
import pytest

from streams.dev.brokers.tls import TlsFiles, make_tls_files
from streams.errors import ConfigError
from streams.kafka import clients
from streams.kafka.acls import markdown
from streams.kafka.security import client_auth, faust_credentials, secrets
from streams.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("pki"))


def secured(**security: Any) -> Settings:
    return load_settings(kafka={"security": security})


@pytest.mark.parametrize(
    ("security", "named"),
    [
        ({"protocol": "SASL_SSL"}, "SASL_MECHANISM"),
        ({"protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u"},
         "SASL_PASSWORD"),
        ({"protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_password": "hunter2"},
         "SASL_USERNAME"),
        ({"protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}, "SASL_OAUTH_TOKEN_PROVIDER"),
        ({"protocol": "PLAINTEXT", "sasl_mechanism": "PLAIN"}, "PROTOCOL"),
        ({"protocol": "PLAINTEXT", "ssl_cafile": "/etc/ca.pem"}, "PROTOCOL"),
        ({"protocol": "SSL", "ssl_certfile": "/etc/c.pem"}, "SSL_KEYFILE"),
    ],
)  # fmt: skip
def test_settings_that_do_not_fit_are_refused_naming_the_setting(
    security: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        secured(**security)
    assert f"LLM_STREAMS_KAFKA__SECURITY__{named}" in str(caught.value)
    assert "hunter2" not in str(caught.value)  # the refused values are not echoed


def test_sasl_ssl_options_for_every_client_with_the_password_from_a_file(
    pki: TlsFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret-from-a-file\n")
    settings = secured(protocol="SASL_SSL", ssl_cafile=str(pki.ca), sasl_mechanism="SCRAM-SHA-512",
                       sasl_username="worker", sasl_password_file=str(password))  # fmt: skip
    options = client_auth(settings)
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_plain_password"] == "s3cret-from-a-file"
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert options["ssl_context"].check_hostname
    made: list[dict[str, Any]] = []
    for name in ("AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"):
        monkeypatch.setattr(clients, name, lambda *a, **kw: made.append(kw))
    clients.producer(settings)
    clients.consumer(settings, purpose="t")
    clients.reader(settings, "scan")
    clients.admin(settings)
    assert len(made) == 4
    assert all(kw["security_protocol"] == "SASL_SSL" and kw["sasl_plain_username"] == "worker"
               for kw in made)  # fmt: skip
    credentials = faust_credentials(settings)
    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.mechanism.value == "SCRAM-SHA-512" and credentials.ssl_context is not None
    assert secrets(settings) == ["s3cret-from-a-file"]


def test_mutual_tls_loads_the_client_certificate_with_its_key_password(pki: TlsFiles) -> None:
    settings = secured(protocol="SSL", ssl_cafile=str(pki.ca), ssl_certfile=str(pki.client.cert),
                       ssl_keyfile=str(pki.client.key), ssl_key_password=pki.key_password)  # fmt: skip
    assert client_auth(settings)["security_protocol"] == "SSL"
    assert isinstance(faust_credentials(settings), faust.SSLCredentials)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"ssl_key_password": "wrong"}, "SSL_KEY_PASSWORD"),
        ({"ssl_cafile": "/nowhere/ca.pem"}, "SSL_CAFILE"),
        ({"expired": True}, "SSL_CERTFILE"),
    ],
)
def test_a_certificate_that_cannot_be_used_is_refused_before_connecting(
    pki: TlsFiles, change: dict[str, Any], named: str
) -> None:
    security: dict[str, Any] = {"protocol": "SSL", "ssl_cafile": str(pki.ca),
                                "ssl_certfile": str(pki.client.cert),
                                "ssl_keyfile": str(pki.client.key),
                                "ssl_key_password": pki.key_password}  # fmt: skip
    if change.pop("expired", False):
        security.update(ssl_certfile=str(pki.expired.cert), ssl_keyfile=str(pki.expired.key))
        security.pop("ssl_key_password")
    security.update(change)
    with pytest.raises(ConfigError) as caught:
        client_auth(secured(**security))
    assert f"LLM_STREAMS_KAFKA__SECURITY__{named}" in str(caught.value)


def test_plaintext_is_the_default_and_faust_gets_no_credentials() -> None:
    settings = load_settings()
    assert client_auth(settings) == {"security_protocol": "PLAINTEXT"}
    assert faust_credentials(settings) is None


def test_the_security_guide_lists_the_acls_the_code_names() -> None:
    guide = (ROOT / "docs" / "SECURITY.md").read_text()
    assert markdown(Settings()) in guide, "docs/SECURITY.md is stale: paste `llm-streams acls`"
