"""The public record contract (v1) and the names every layer shares: record models,
result keys, header names, lanes and tiers. Imports nothing of ours but errors."""
