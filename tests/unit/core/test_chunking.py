"""Chunking long inputs and merging the chunks' answers, alone and through the processor."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from streams.contract.records import Source
from streams.core.chunking import reduce_outputs, split_text
from streams.core.processor import TaskProcessor
from streams.core.spend import Prices
from streams.dev.simulator import SimulatorServer
from streams.errors import ConfigError
from streams.llm.openai_client import OpenAIClient
from streams.llm.tokens import counter
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]
COUNT = counter()


def _long_comment(parts: int = 40) -> str:
    sentences = []
    for i in range(parts):
        if i == 5:
            sentences.append("The delivery was late by a week.")
        elif i == parts - 5:
            sentences.append("The packaging was crushed and the lid broke.")
        else:
            sentences.append(f"Part {i} of the blender works fine and looks nice.")
    return " ".join(sentences[: parts // 2]) + "\n\n" + " ".join(sentences[parts // 2 :])


def test_chunks_fit_the_budget_keep_order_and_overlap() -> None:
    text = _long_comment(60)
    chunks = split_text(text, 120, 30, COUNT)
    assert len(chunks) > 3
    assert all(COUNT(c) <= 120 for c in chunks)
    # Every sentence is in some chunk, and in order: joining without overlaps gives the text.
    sentences = [s for s in text.replace("\n\n", " ").split(". ") if s]
    positions = [next(i for i, c in enumerate(chunks) if s.strip(". ") in c) for s in sentences]
    assert positions == sorted(positions)
    # Cuts fall on sentence ends, and each chunk after the first repeats the last
    # sentence(s) of the one before (overlap of whole sentences).
    for before, after in itertools.pairwise(chunks):
        assert before.endswith(".")
        last = before.rsplit(". ", 1)[-1]
        assert last in after  # sentences are unique: it was carried over


def test_chinese_text_is_cut_at_sentence_ends_and_long_sentences_by_tokens() -> None:
    text = "物流很快，包装完好。" * 30 + "质量一般！" * 30
    chunks = split_text(text, 50, 10, COUNT)
    assert all(COUNT(c) <= 50 for c in chunks) and len(chunks) > 2
    assert all(c.endswith(("。", "！")) for c in chunks)
    one_sentence = "非常" * 400 + "好。"
    pieces = split_text(one_sentence, 64, 8, COUNT)
    assert all(COUNT(p) <= 64 for p in pieces) and "".join(pieces) == one_sentence


def test_no_chunk_is_only_the_overlap_of_the_one_before() -> None:
    chunks = split_text("One. Two. Three. Four.", 4, 2, COUNT)
    assert chunks and all(COUNT(c) <= 4 for c in chunks)
    assert "Four." in chunks[-1] and len(set(chunks)) == len(chunks)


SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string"},
        "score": {"type": "number"},
        "tags": {"type": "array", "maxItems": 3},
        "summary": {"type": "string", "maxLength": 12},
        "flag": {"type": "boolean"},
    },
}


def test_reducers() -> None:
    outputs = [
        {"label": "neg", "score": 0.9, "tags": ["a", "b"], "summary": "first part", "flag": True},
        {"label": "pos", "score": 0.3, "tags": ["b", "c"], "summary": "second", "flag": False},
        {"label": "pos", "score": 0.3, "tags": [{"x": 1}, "d"], "summary": "", "flag": False},
    ]
    merged = reduce_outputs(
        outputs,
        {"label": "vote", "score": "mean", "tags": "union", "summary": "join", "flag": "any"},
        SCHEMA, weight_field="score",
    )  # fmt: skip
    assert merged["label"] == "neg"  # 0.9 outweighs 0.3 + 0.3
    assert merged["score"] == pytest.approx(0.5)
    assert merged["tags"] == ["a", "b", "c"]  # deduplicated, cut to maxItems 3
    assert merged["summary"] == "first part s"[:12].rstrip()
    assert merged["flag"] is True
    assert reduce_outputs(outputs, {"label": "majority"}, SCHEMA)["label"] == "pos"
    # Ties go to the earliest chunk; fields without a reducer take the first value.
    tie = reduce_outputs(outputs[:2], {"label": "majority", "flag": "all"}, SCHEMA)
    assert tie["label"] == "neg" and tie["flag"] is False and tie["score"] == 0.9
    assert reduce_outputs(outputs, {"score": "max"}, SCHEMA)["score"] == 0.9
    assert reduce_outputs(outputs, {"summary": "longest"}, SCHEMA)["summary"] == "first part"


@pytest.fixture
async def processor(
    simulator: SimulatorServer, make_processor: MakeProcessor
) -> AsyncIterator[TaskProcessor]:
    client = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=1, read_timeout_s=2
    )
    guarded = GuardedClient(
        client, limiter=RateLimiter(rpm=1_000_000), breaker=CircuitBreaker("sim", min_calls=1000)
    )
    yield make_processor(
        guarded=guarded, policy=RetryPolicy(max_attempts=2, backoff_base_s=0.001),
        deadline_s=10, max_task_bytes=20_000, prices=Prices(prompt_per_1k=1.0),
        context_window=1200,  # a small local model: 1,020 usable, 400 for the answer
    )  # fmt: skip
    await client.close()


def _task(text: str, task_id: str = "long-1") -> bytes:
    return orjson.dumps({"task_id": task_id, "pipeline": "comment-analysis",
                         "input": {"text": text, "rating": 2}})  # fmt: skip


async def test_a_long_comment_is_answered_in_chunks_and_merged(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    text = _long_comment(60)
    assert COUNT(text) > 700  # more than the window leaves for it
    out = await processor.process(_task(text), b"long-1", Source(topic="t", partition=0, offset=1))
    assert out.kind == "result", orjson.loads(out.value)
    result = orjson.loads(out.value)
    calls = simulator.sim.snapshot()["requests"]
    assert calls >= 2 and result["attempts"] == calls
    pipeline = processor.registry.get("comment-analysis")
    assert pipeline.is_valid(result["output"])
    # Issues found in different chunks are all there, each quoting the comment.
    evidence = {i["evidence"] for i in result["output"]["issues"]}
    assert any("delivery" in e for e in evidence) and any("packaging" in e for e in evidence)
    assert all(e in text for e in evidence)
    assert result["usage"]["prompt_tokens"] > 0 and result["cost_usd"] > 0


async def test_a_short_comment_is_one_call(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    out = await processor.process(_task("Late, but works.", "short"), None,
                                  Source(topic="t", partition=0, offset=2))  # fmt: skip
    assert out.kind == "result" and simulator.sim.snapshot()["requests"] == 1


async def test_too_many_chunks_is_a_dead_letter_before_any_call(
    processor: TaskProcessor, simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    processor = make_processor(  # leaves ~60 tokens per chunk: 1,700 need over 16
        guarded=processor.client, max_task_bytes=20_000, context_window=820
    )
    text = _long_comment(400)[:7_900]  # within the slot's max_length
    out = await processor.process(_task(text), None, Source(topic="t", partition=0, offset=3))
    assert out.kind == "dead_letter"
    error = orjson.loads(out.value)["error"]
    assert (error["category"], error["code"]) == ("context_overflow", "too_many_chunks")
    assert simulator.sim.snapshot()["requests"] == 0


async def test_a_failing_chunk_fails_the_task_and_says_which(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    simulator.sim.config.error_500_rate = 1.0
    out = await processor.process(_task(_long_comment(60)), None,
                                  Source(topic="t", partition=0, offset=4))  # fmt: skip
    assert out.kind == "dead_letter"
    letter = orjson.loads(out.value)
    assert letter["error"]["category"] == "upstream_error"
    assert letter["error"]["message"].startswith("chunk 1 of ")
    # Every chunk's attempts are counted, and paid for.
    assert letter["attempts"] == simulator.sim.snapshot()["requests"] >= 4


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("chunking: {slot: text, reduce: {sentiment: average}}", "unknown reducers"),
        ("chunking: {slot: text, reduce: {mood: vote}}", "not in the schema"),
        ("chunking: {slot: rating}", "not a string slot"),
        ("chunking: {slot: text, max_tokens: 100, overlap_tokens: 60}", "under half"),
    ],
)
def test_a_wrong_chunking_block_is_refused_when_the_pipeline_loads(
    tmp_path: Path, block: str, message: str
) -> None:
    spec = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    start, end = spec.index("chunking:"), spec.index("versions:")
    (tmp_path / "comment-analysis.yaml").write_text(spec[:start] + block + "\n" + spec[end:])
    with pytest.raises(ConfigError, match=message):
        PipelineRegistry.load(tmp_path, ROOT / "schemas")


def test_every_reducer_a_pipeline_may_name_exists() -> None:
    from streams.core.chunking import _REDUCE
    from streams.pipelines.specs import REDUCERS

    assert set(_REDUCE) == set(REDUCERS)


async def test_a_chunk_over_a_window_learned_since_the_plan_is_cut_again(
    processor: TaskProcessor, simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunks were planned for the window as it seemed; before they all went, the
    server's answers showed it counts more tokens than we do (a smaller window in ours):
    a chunk that no longer fits is cut in chunks of the window now known, not
    dead-lettered as context_overflow."""
    known = processor.client.window.tokens()

    async def as_planned(model: str) -> int:
        return int(known * 1.4)  # what the plan saw; the calls check against `known`

    monkeypatch.setattr(processor.client, "context_window", as_planned)
    out = await processor.process(_task(_long_comment(130)), None,
                                  Source(topic="t", partition=0, offset=5))  # fmt: skip
    result = orjson.loads(out.value)
    assert out.kind == "result", result
    assert processor.registry.get("comment-analysis").is_valid(result["output"])
    assert result["attempts"] == simulator.sim.snapshot()["requests"]


def test_a_text_without_a_sentence_end_is_cut_by_tokens_reading_it_once(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A slot of one 'sentence' (a pasted log, base64, a language without . ! ?) was cut
    by taking a head off the rest again and again, each time encoding the whole rest:
    for 1 MB, 200 encodings of up to 1 MB, 8 s of the worker's event loop."""
    import tiktoken

    from streams.llm import tokens

    count = counter()  # bound before the encoder counts: its own counts are not counted
    encoded: list[int] = []
    real = tiktoken.Encoding.encode_ordinary

    def counted(self: tiktoken.Encoding, text: str) -> list[int]:
        encoded.append(len(text))
        return real(self, text)

    monkeypatch.setattr(tiktoken.Encoding, "encode_ordinary", counted)
    tokens._codec.cache_clear()  # bound again, to the counting encoder; and after the test
    request.addfinalizer(tokens._codec.cache_clear)
    text = ("ü😀中文 lorem-ipsum_" * 6000) + "the end"  # no sentence end, multi-byte runs
    chunks = split_text(text, 300, 0, count=count)
    assert 0 < sum(encoded) <= 2 * len(text)  # each character encoded once, not once a chunk
    # Nothing lost, nothing doubled (no overlap; a chunk's own edges are trimmed).
    assert "".join("".join(chunks).split()) == "".join(text.split())
    assert len(chunks) > 100 and max(count(c) for c in chunks) <= 301


async def test_a_chunk_cut_again_books_every_part_when_one_fails(
    processor: TaskProcessor, simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk cut again (as above) whose first part fails for good: the parts after it
    were answered and paid for, but their tokens were left out of the task's spend (its
    dead letter's cost, the pipeline's budget)."""
    known = processor.client.window.tokens()

    async def as_planned(model: str) -> int:
        return int(known * 1.4)

    monkeypatch.setattr(processor.client, "context_window", as_planned)
    simulator.sim.config.malformed_if_prompt_has = {"late by a week": 1.0}
    out = await processor.process(_task(_long_comment(130)), None,
                                  Source(topic="t", partition=0, offset=6))  # fmt: skip
    assert out.kind == "dead_letter" and out.category == "invalid_output"
    paid = simulator.sim.snapshot()
    assert paid["requests"] > 3  # the failing part, and parts after it answered
    assert out.prompt_tokens == paid["prompt_tokens"]
    assert out.completion_tokens == paid["completion_tokens"]
