"""llm-streams: run LLM work on every record of a Kafka topic."""

__version__ = "0.1.0"
