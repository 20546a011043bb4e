"""How every Kafka client of the project connects: TLS, mutual TLS, SASL (PLAIN, SCRAM,
OAUTHBEARER, AWS MSK IAM) — built here once from `settings.kafka.security`, for aiokafka
(`client_auth`) and for the Faust app (`faust_credentials`), and checked at start
(`preflight`): a wrong password, an untrusted or expired certificate, or a listener
that speaks another protocol is said in one line naming the setting to fix, within
seconds, instead of aiokafka's "Unable to bootstrap" after its retries. Secrets are
read from the environment or from files (mounted Kubernetes secrets) and only ever
handed to the client libraries.
"""

from __future__ import annotations

import asyncio
import importlib
import socket
import ssl
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaError, KafkaTimeoutError, SaslAuthenticationFailed

from streams.errors import ConfigError
from streams.settings import KafkaSecurity, Settings, bootstrap_servers

ENV = "LLM_STREAMS_KAFKA__SECURITY__"
PREFLIGHT_TIMEOUT_S = 15.0


def _read(path: Path, setting: str) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{ENV}{setting}: cannot read {path}: {exc.strerror}") from None


def _secret(value: Any, path: Path | None, setting: str) -> str | None:
    """A secret from its variable or its file (`<SETTING>_FILE`)."""
    if path is not None:
        return _read(path, f"{setting}_FILE")
    if value is None:
        return None
    return str(value.get_secret_value() if hasattr(value, "get_secret_value") else value)


def _readable(path: Path | None, setting: str) -> str | None:
    if path is None:
        return None
    if not path.is_file():
        raise ConfigError(f"{ENV}{setting}: {path} is not a readable file")
    return str(path)


def ssl_context(sec: KafkaSecurity) -> ssl.SSLContext:
    """The TLS context: the CA bundle (or the system's), hostname checks, a client
    certificate for mutual TLS."""
    cafile = _readable(sec.ssl_cafile, "SSL_CAFILE")
    try:
        context = ssl.create_default_context(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(f"{ENV}SSL_CAFILE: {cafile} holds no CA certificate: {exc}") from None
    context.check_hostname = sec.ssl_check_hostname
    certfile = _readable(sec.ssl_certfile, "SSL_CERTFILE")
    keyfile = _readable(sec.ssl_keyfile, "SSL_KEYFILE")
    if certfile and keyfile:
        _not_expired(Path(certfile))
        password = _secret(sec.ssl_key_password, sec.ssl_key_password_file, "SSL_KEY_PASSWORD")
        try:
            context.load_cert_chain(certfile, keyfile, password)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{ENV}SSL_CERTFILE / {ENV}SSL_KEYFILE: cannot load the client certificate and "
                f"key ({exc.reason or exc}): a wrong {ENV}SSL_KEY_PASSWORD, or a key of "
                "another certificate"
            ) from None
    return context


def _not_expired(certfile: Path) -> None:
    """Refuse a client certificate that is out of its validity: the broker would only
    close the connection, with no word why."""
    try:  # CPython's decoder of a PEM certificate's fields (no public equivalent)
        fields = ssl._ssl._test_decode_cert(str(certfile))  # type: ignore[attr-defined]  # noqa: SLF001
    except (AttributeError, ssl.SSLError, ValueError):
        return  # cannot tell here; the broker will
    now = time.time()
    if ssl.cert_time_to_seconds(fields["notAfter"]) < now:
        raise ConfigError(f"{ENV}SSL_CERTFILE: {certfile} expired on {fields['notAfter']}")
    if ssl.cert_time_to_seconds(fields["notBefore"]) > now:
        raise ConfigError(
            f"{ENV}SSL_CERTFILE: {certfile} is not valid before {fields['notBefore']}"
        )


class MskIamTokens(AbstractTokenProvider):  # type: ignore[misc]  # aiokafka is untyped
    """OAUTHBEARER tokens for AWS MSK with IAM, signed with the process's AWS credentials."""

    def __init__(self, region: str) -> None:
        try:
            from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
        except ImportError:
            raise ConfigError(
                f"{ENV}SASL_OAUTH_MSK_REGION needs the `msk` extra: "
                "pip install 'llm-streams[msk]' (aws-msk-iam-sasl-signer-python)"
            ) from None
        self.region = region
        self._provider = MSKAuthTokenProvider

    async def token(self) -> str:
        token, _expiry_ms = await asyncio.to_thread(self._provider.generate_auth_token, self.region)
        return str(token)


def token_provider(sec: KafkaSecurity) -> AbstractTokenProvider:
    if sec.sasl_oauth_msk_region:
        return MskIamTokens(sec.sasl_oauth_msk_region)
    target = sec.sasl_oauth_token_provider or ""
    module_name, _, attr = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{ENV}SASL_OAUTH_TOKEN_PROVIDER: cannot load {target!r} "
                          f"(module:name): {exc}") from None  # fmt: skip
    provider = found() if isinstance(found, type) else found
    if not isinstance(provider, AbstractTokenProvider):
        raise ConfigError(f"{ENV}SASL_OAUTH_TOKEN_PROVIDER: {target!r} is no aiokafka "
                          "AbstractTokenProvider")  # fmt: skip
    return provider


@lru_cache(maxsize=8)
def _auth(sec: KafkaSecurity) -> tuple[tuple[str, Any], ...]:
    options: dict[str, Any] = {"security_protocol": sec.protocol}
    if sec.protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = ssl_context(sec)
    if sec.sasl_mechanism is not None:
        options["sasl_mechanism"] = sec.sasl_mechanism
    if sec.sasl_mechanism == "OAUTHBEARER":
        options["sasl_oauth_token_provider"] = token_provider(sec)
    elif sec.sasl_mechanism is not None:
        username = sec.sasl_username
        if sec.sasl_username_file is not None:
            username = _read(sec.sasl_username_file, "SASL_USERNAME_FILE")
        options["sasl_plain_username"] = username
        options["sasl_plain_password"] = _secret(
            sec.sasl_password, sec.sasl_password_file, "SASL_PASSWORD"
        )
    return tuple(options.items())


def client_auth(settings: Settings) -> dict[str, Any]:
    """The aiokafka options of every producer, consumer and admin client (one TLS
    context and token provider per configuration, reused)."""
    return dict(_auth(settings.kafka.security))


def secrets(settings: Settings) -> list[str]:
    """The Kafka secrets the logs must never show (the SASL password, the key's password)."""
    sec = settings.kafka.security
    found = []
    for value, path, name in (
        (sec.sasl_password, sec.sasl_password_file, "SASL_PASSWORD"),
        (sec.ssl_key_password, sec.ssl_key_password_file, "SSL_KEY_PASSWORD"),
    ):
        try:
            secret = _secret(value, path, name)
        except ConfigError:
            continue  # the start says what is wrong with it
        if secret:
            found.append(secret)
    return found


def faust_credentials(settings: Settings) -> Any:
    """The same configuration as Faust's `broker_credentials` (None: plaintext)."""
    import faust

    options = client_auth(settings)
    protocol = options["security_protocol"]
    context = options.get("ssl_context")
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    if options["sasl_mechanism"] == "OAUTHBEARER":
        return faust.OAuthCredentials(
            oauth_cb=options["sasl_oauth_token_provider"], ssl_context=context
        )
    return faust.SASLCredentials(
        username=options["sasl_plain_username"],
        password=options["sasl_plain_password"],
        mechanism=options["sasl_mechanism"],
        ssl_context=context,
    )


async def preflight(settings: Settings, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Connect to the first reachable bootstrap server the way every client will, and
    say plainly what is wrong when it cannot: ConfigError naming the setting."""
    sec = settings.kafka.security
    options = client_auth(settings)
    problems = []
    away = True  # every server failed for a reason waiting may mend
    for server in bootstrap_servers(settings.kafka.broker_url).split(","):
        host, _, port = server.rpartition(":")
        try:
            async with asyncio.timeout(timeout_s):
                conn = await create_conn(host, int(port), client_id="llm-streams-preflight",
                                         **options)  # fmt: skip
        except SaslAuthenticationFailed as exc:
            raise ConfigError(
                f"Kafka at {server} refused the credentials ({sec.sasl_mechanism}): check "
                f"{ENV}SASL_USERNAME and {ENV}SASL_PASSWORD ({exc.args[0] if exc.args else ''})"
            ) from None
        except ssl.SSLCertVerificationError as exc:
            hint = (f"{ENV}SSL_CHECK_HOSTNAME" if "hostname" in str(exc.verify_message)
                    else f"{ENV}SSL_CAFILE")  # fmt: skip
            raise ConfigError(
                f"the certificate of Kafka at {server} is not trusted "
                f"({exc.verify_message}): check {hint}"
            ) from None
        except (KafkaError, OSError, TimeoutError) as exc:
            problems.append(f"{server}: {_why(exc, sec)}")
            away = away and broker_away(exc)
            continue
        conn.close()
        return
    message = "cannot reach Kafka: " + "; ".join(problems)
    raise BrokerAway(message) if away else ConfigError(message)


class BrokerAway(ConfigError):
    """No bootstrap server answered, each for a reason that may heal by waiting (refused,
    no answer, reset: a broker restarting, a failover); not a wrong name or credential."""


def broker_away(exc: BaseException) -> bool:
    """An error of reaching Kafka that waiting may mend: a refused, reset or timed-out
    connection, a broker not ready — not an unknown host (a DNS outage is), a refused
    credential or certificate."""
    if isinstance(exc, BrokerAway):
        return True
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN  # the resolver is away, not the name wrong
    if isinstance(exc, ssl.SSLError):
        return False
    if isinstance(exc, KafkaError):  # aiokafka says which of its errors a retry may mend
        return bool(exc.retriable) or isinstance(exc, KafkaTimeoutError)
    return isinstance(exc, ConnectionError | TimeoutError)


def _why(exc: BaseException, sec: KafkaSecurity) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, TimeoutError):
        text = "no answer"
    if sec.protocol in ("SSL", "SASL_SSL") and sec.ssl_certfile is not None:
        return (f"{text} — the broker closed the TLS connection: it does not accept the "
                f"client certificate {ENV}SSL_CERTFILE (not signed by a CA it trusts?), or "
                f"{ENV}PROTOCOL is not what this listener speaks")  # fmt: skip
    return (f"{text} — check LLM_STREAMS_KAFKA__BROKER_URL and {ENV}PROTOCOL "
            f"({sec.protocol}) against the listener")  # fmt: skip


__all__ = [
    "BrokerAway",
    "broker_away",
    "client_auth",
    "faust_credentials",
    "preflight",
    "secrets",
    "ssl_context",
    "token_provider",
]
