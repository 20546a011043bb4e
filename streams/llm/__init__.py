"""LLM layer: a small client protocol, the OpenAI SDK adapter, the local simulator."""

from streams.llm.client import LLMClient, LLMRequest, LLMResponse

__all__ = ["LLMClient", "LLMRequest", "LLMResponse"]
