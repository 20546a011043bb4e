"""Development tooling: the LLM simulator, broker launchers, the demo. Never imported
on the worker's path (a test checks the import graph)."""
