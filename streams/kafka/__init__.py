"""The Kafka side of llm-streams: clients built from settings, reads to the real end of a
partition, and the size limits every write must fit."""
