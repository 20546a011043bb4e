"""Metrics (one registry, bounded labels), tracing, scrubbed logs, the status view."""
