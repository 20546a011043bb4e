"""Brokers llm-streams can start by itself: Tansu (demo), Apache Kafka from jars (tests),
the official Kafka image under Docker (tests where Docker runs)."""
