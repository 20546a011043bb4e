"""`python -m streams …`: Faust's own CLI on the llm-streams app, e.g. `… worker`."""

from __future__ import annotations


def main() -> None:
    from streams.worker.app import app

    app.main()


if __name__ == "__main__":
    main()
