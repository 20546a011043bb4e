"""Operator work over the topics: replay, backtrack, diff, redrive."""
