"""Brokers llm-streams can start by itself: Tansu (demo) and Apache Kafka from jars (tests)."""
