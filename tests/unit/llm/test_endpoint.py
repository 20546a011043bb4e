"""What an endpoint says of itself, read from each server's own bodies (those of a real
llama.cpp server as it answered here), and the window a client keeps of it."""

from __future__ import annotations

import pytest

from streams.llm.endpoint import DEFAULT_WINDOW, ContextWindow, EndpointFacts, facts_from

LLAMA_MODELS = {"models": [{"name": "smollm2", "model": "smollm2"}], "object": "list",
                "data": [{"id": "smollm2", "object": "model", "owned_by": "llamacpp",
                          "meta": {"vocab_type": 2, "n_ctx": 2048, "n_ctx_train": 8192}}]}  # fmt: skip
LLAMA_PROPS = {"default_generation_settings": {"n_ctx": 2048}, "total_slots": 2,
               "model_alias": "smollm2"}  # fmt: skip


def test_llama_cpp_says_its_window_per_slot_and_its_slots() -> None:
    facts = facts_from("comment-model", LLAMA_MODELS, LLAMA_PROPS, server="llama.cpp")
    assert (facts.server, facts.context_window, facts.slots) == ("llama.cpp", 2048, 2)
    assert facts.models == ("smollm2",)  # one model: it answers under any name


def test_vllm_openrouter_groq_and_ollama_say_theirs_where_they_do() -> None:
    vllm = {"data": [{"id": "Qwen/Qwen2.5-7B", "owned_by": "vllm", "max_model_len": 32768},
                     {"id": "other", "owned_by": "vllm", "max_model_len": 8192}]}  # fmt: skip
    assert facts_from("Qwen/Qwen2.5-7B", vllm).context_window == 32768
    assert facts_from("Qwen/Qwen2.5-7B", vllm).server == "vllm"
    assert facts_from("missing", vllm).context_window is None  # two models, none named so
    router = {"data": [{"id": "a/b", "context_length": 131072}]}
    assert facts_from("a/b", router).context_window == 131072
    groq = {"data": [{"id": "llama-3.1-8b-instant", "context_window": 131072}]}
    assert facts_from("llama-3.1-8b-instant", groq).context_window == 131072
    show = {"parameters": 'stop "<|im_end|>"\nnum_ctx 8192\ntemperature 0.7'}
    ollama = facts_from("qwen2.5", {"data": [{"id": "qwen2.5"}]}, None, show)
    assert (ollama.server, ollama.context_window) == ("ollama", 8192)
    openai = {"data": [{"id": "gpt-4o-mini", "owned_by": "system"}, {"id": "gpt-4o"}]}
    assert facts_from("gpt-4o-mini", openai).context_window is None  # says nothing


OLLAMA_PS = {"models": [{"name": "qwen2.5:latest", "model": "qwen2.5:latest",
                         "size_vram": 0, "context_length": 4096}]}  # fmt: skip


def test_ollama_says_the_window_its_loaded_model_was_given() -> None:
    """A model's `num_ctx` in `/api/show` is set by few modelfiles; the window Ollama gives
    it (4,096 tokens under 24 GiB of VRAM, or OLLAMA_CONTEXT_LENGTH) shows in `/api/ps`
    once it is loaded, under the name with its `:latest` tag. Without it, a prompt over it
    was cut silently by Ollama while the worker counted on 128,000 tokens."""
    listed = {"data": [{"id": "qwen2.5"}]}
    quiet = {"parameters": 'stop "<|im_end|>"'}
    assert facts_from("qwen2.5", listed, None, quiet).context_window is None
    assert facts_from("qwen2.5", listed, None, quiet, running=OLLAMA_PS).context_window == 4096
    tagged = facts_from("qwen2.5:latest", listed, None, quiet, running=OLLAMA_PS)
    assert tagged.context_window == 4096
    # What it was given wins over what the modelfile asks; not loaded: the modelfile's.
    show = {"parameters": "num_ctx 8192"}
    assert facts_from("qwen2.5", listed, None, show, running=OLLAMA_PS).context_window == 4096
    other = facts_from("llama3.2", listed, None, show, running=OLLAMA_PS)
    assert other.context_window == 8192
    for odd in ({"models": [{"name": ["qwen2.5"]}]}, {"models": {"qwen2.5": 1}}, [1], "x"):
        assert facts_from("qwen2.5", listed, None, show, running=odd).context_window == 8192


@pytest.mark.parametrize(
    "models", [{"data": True}, {"data": 5}, {"data": "m"}, {"data": {"id": "m"}}, [1], "x"]
)
def test_a_model_list_of_another_shape_says_nothing_rather_than_failing(models: object) -> None:
    """What `GET /v1/models` answers is asked at start and before the first call: a body
    of another shape failed both (the worker's start, then every task) with a TypeError."""
    facts = EndpointFacts(server="llama.cpp", context_window=2048, slots=2)
    assert facts_from("m", models, LLAMA_PROPS) == facts


def test_a_window_set_wins_then_an_overflows_then_the_endpoints() -> None:
    window = ContextWindow()
    assert (window.server_tokens, window.source) == (DEFAULT_WINDOW, "default")
    window.tell(4096)
    assert (window.server_tokens, window.source) == (4096, "endpoint")
    window.overflowed(2048, None, 0)
    assert (window.server_tokens, window.source) == (2048, "overflow")
    window.configured = 8000
    assert (window.server_tokens, window.source) == (8000, "setting")


def test_a_server_that_counts_more_tokens_than_we_do_gets_prompts_fitted_to_its_count() -> None:
    """SmolLM's tokenizer counts Chinese at several times o200k's: fitted with our count,
    every chunk would overflow. A server that counts fewer leaves a margin instead."""
    window = ContextWindow()
    window.tell(2048)
    window.overflowed(None, 3000, 1000)  # it counted a prompt at 3x ours
    for _ in range(20):
        window.count(3000, 1000)
    assert 2.9 < window.ratio <= 3.0 and window.tokens() == int(2048 / window.ratio)
    fewer = ContextWindow()
    fewer.tell(4096)
    fewer.count(4510, 5610)  # Qwen's tokenizer on a Chinese comment, against o200k
    assert fewer.ratio == 1.0 and fewer.tokens() == 4096
    answers = [fewer.wants_sample() for _ in range(200)]
    assert answers[:8] == [True] * 8 and sum(answers) == 8 + 4  # then one in fifty


async def test_a_llama_cpp_server_is_described_and_its_window_learned_by_the_client() -> None:
    """The simulator playing llama.cpp's server (the shapes of a real one): the client asks
    it what it is, and its guarded client takes the window and the slots from there; an
    overflow refusal in llama.cpp's words is a context_overflow with its numbers."""
    from streams.dev.simulator import SimConfig, SimulatorServer
    from streams.errors import ContextOverflow
    from streams.llm.client import LLMRequest
    from streams.llm.openai_client import OpenAIClient
    from streams.resilience.breaker import CircuitBreaker
    from streams.resilience.concurrency import ConcurrencyLimit
    from streams.resilience.guarded import GuardedClient
    from streams.resilience.limiter import RateLimiter

    server = SimulatorServer(SimConfig(server="llama.cpp", context_window=512,
                                       max_concurrency=3, api_key="k"))  # fmt: skip
    await server.start()
    client = OpenAIClient(base_url=server.base_url, api_key="k", connect_timeout_s=2,
                          read_timeout_s=5)  # fmt: skip
    try:
        facts = await client.describe("whatever")
        assert (facts.server, facts.context_window, facts.slots) == ("llama.cpp", 512, 3)
        guarded = GuardedClient(client, limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("s"),
                                concurrency=ConcurrencyLimit())  # fmt: skip
        assert await guarded.context_window("whatever") == 512
        assert guarded.concurrency.current == 4  # its 3 slots and one ready
        long = LLMRequest(messages=[{"role": "user", "content": "word " * 800}], model="m",
                          params={"max_tokens": 10})  # fmt: skip
        try:
            await guarded.complete(long)
        except ContextOverflow as exc:
            assert exc.window == 512 and exc.prompt_tokens and exc.prompt_tokens > 512
        else:
            raise AssertionError("the prompt is over the window")
        short = LLMRequest(messages=[{"role": "user", "content": "<comment>fine</comment>"}],
                           model="m", params={"max_tokens": 200})  # fmt: skip
        answer = await guarded.complete(short)
        assert answer.server_s is not None and not answer.rate_headers
    finally:
        await client.close()
        await server.stop()
