"""LLM layer: a small client protocol, the OpenAI SDK adapter (error mapping, Batch API),
the offline tokenizer."""

from streams.llm.client import LLMClient, LLMRequest, LLMResponse

__all__ = ["LLMClient", "LLMRequest", "LLMResponse"]
