"""Cleaning and PII redaction before prompts: what is caught, what is left, what is counted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.contract.records import Source
from streams.errors import ConfigError
from streams.llm.client import LLMRequest
from streams.llm.openai_client import OpenAIClient
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.preprocess import Redactor, clean, luhn, valid_cn_id
from streams.resilience.retry import RetryPolicy
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[2]


def redact(text: str, **kwargs: Any) -> tuple[str, Counter[str]]:
    counts: Counter[str] = Counter()
    return Redactor(**kwargs).redact(clean(text), counts), counts


def test_checksums() -> None:
    assert valid_cn_id("11010519491231002X") and valid_cn_id("11010519491231002x")
    assert not valid_cn_id("110105194912310021") and not luhn("110105194912310021")
    assert luhn("4111111111111111") and luhn("6011000990139424")
    assert not luhn("4111111111111112")


@pytest.mark.parametrize(
    ("text", "expected", "kind"),
    [
        ("mail me at zhang.san@example.com.cn please", "mail me at [EMAIL] please", "email"),
        ("身份证 11010519491231002X 已提供", "身份证 [ID_NUMBER] 已提供", "cn_id"),
        ("card 4111 1111 1111 1111 charged twice", "card [BANK_CARD] charged twice", "bank_card"),
        ("card 6011-0009-9013-9424.", "card [BANK_CARD].", "bank_card"),
        ("call 13812345678 now", "call [PHONE] now", "phone"),
        ("call +86 138 1234 5678 now", "call [PHONE] now", "phone"),
        ("电话１３８１２３４５６７８谢谢", "电话[PHONE]谢谢", "phone"),  # full-width digits
        ("ring +44 20 7946 0958 today", "ring [PHONE] today", "phone"),
        ("ring (555) 123-4567 today", "ring [PHONE] today", "phone"),
    ],
)
def test_personal_data_is_tagged_and_counted(text: str, expected: str, kind: str) -> None:
    redacted, counts = redact(text)
    assert redacted == expected
    assert counts == Counter({kind: 1})


@pytest.mark.parametrize(
    "text",
    [
        "order 110105194912310021 arrived",  # 18 digits, wrong ID check digit, fails Luhn
        "card 4111 1111 1111 1112 is not a card number",  # fails Luhn
        "tracking 1234567 and SKU 98765, 3 pcs, 2026-11-29",
        "rated 5/5, paid 199.00",
        # Fractions of decimals whose digits pass Luhn (timings in logs, ratios).
        "runtime=0.4111111111111111 s",
        "ratio 3,4111111111111111 and 0.4242424242424242",
    ],
)
def test_numbers_that_fail_the_checks_are_left_alone(text: str) -> None:
    redacted, counts = redact(text)
    assert redacted == text and not counts


def test_kinds_can_be_switched_off_and_patterns_added() -> None:
    text = "order ORD-12345678 from a@b.io"
    redacted, counts = redact(text, kinds=["phone"], extra={"order_no": r"ORD-\d{8}"})
    assert redacted == "order [ORDER_NO] from a@b.io"
    assert counts == Counter({"order_no": 1})
    with pytest.raises(ValueError, match="unknown PII kinds"):
        Redactor(kinds=["ssn"])


def test_cleaning() -> None:
    assert clean("  a\x00b\u200b  c\t\td\r\n\n\n\ne ") == "ab c d\n\ne"
    assert clean("ＡＢＣ１２３") == "ABC123"


def test_a_bad_extra_pattern_is_refused_when_the_pipeline_loads(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    spec["preprocess"] = {"extra_patterns": {"order_no": "ORD-(\\d"}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="not a regex"):
        PipelineRegistry.load(tmp_path, ROOT / "schemas")


async def test_no_raw_pii_reaches_the_llm_and_redactions_are_counted(
    monkeypatch: pytest.MonkeyPatch, make_processor: MakeProcessor
) -> None:
    sent: list[LLMRequest] = []

    async def capture(self: OpenAIClient, request: LLMRequest) -> Any:
        sent.append(request)
        raise AssertionError("stop here")  # the request is what this test is about

    monkeypatch.setattr(OpenAIClient, "complete", capture)
    metrics = Metrics()
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")

    client = OpenAIClient(base_url="http://127.0.0.1:9/v1", api_key="k", connect_timeout_s=1,
                          read_timeout_s=1)  # fmt: skip
    processor = make_processor(client, registry=registry, metrics=metrics, default_model="m",
                               policy=RetryPolicy(max_attempts=1))  # fmt: skip
    pii = ["li.lei@example.com", "13812345678", "11010519491231002X", "4111 1111 1111 1111"]
    text = "Broken on arrival. Contact " + ", ".join(pii) + "."
    task = {"task_id": "t1", "pipeline": "comment-analysis", "input": {"text": text}}
    await processor.process(orjson.dumps(task), b"t1", Source(topic="t", partition=0, offset=1))
    await client.close()
    assert sent, "the processor never called the client"
    prompt = orjson.dumps([r.messages for r in sent]).decode()
    assert not [p for p in pii if p in prompt]
    assert "[EMAIL]" in prompt and "[BANK_CARD]" in prompt
    for kind in ("email", "phone", "cn_id", "bank_card"):
        assert metrics.redactions.labels("comment-analysis", kind)._value.get() == 1


def test_an_email_is_found_where_it_was_before_the_pattern_began_only_at_runs() -> None:
    """The email pattern starts its local part only where a run of its characters starts
    (tried at each position of a long run without an @, it cost the square of the run's
    length: `bench/hostile_inputs.py`). Whatever the text, it finds what it found."""
    import random
    import re

    from streams.preprocess import _EMAIL

    before = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
    rng = random.Random(5)
    for _ in range(5000):
        text = "".join(rng.choice("ab.%+-@x1 .com\n_中") for _ in range(rng.randint(1, 80)))
        assert [m.span() for m in _EMAIL.finditer(text)] == [
            m.span() for m in before.finditer(text)
        ], text
    counts: Counter[str] = Counter()
    redacted = Redactor().redact("write to x.y+z@mail.example.com or a@b.cn!", counts)
    assert redacted == "write to [EMAIL] or [EMAIL]!" and counts["email"] == 2
