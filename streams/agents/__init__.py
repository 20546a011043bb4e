"""Thin Faust agents: decode -> processing -> send -> ack."""
