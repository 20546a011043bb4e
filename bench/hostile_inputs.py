"""What a large hostile slot costs the event loop before its call — cleaning, PII
redaction and its template's delimiters guarded (`version.bind` of the shipped
comment-analysis, its slot's max_length taken off as for a pipeline that chunks), cutting it into chunks (`chunking.split_text`) — and a large
hostile answer after it (its Markdown fence taken off: `llm.client.unfenced`).

One process. Each text is one slot as a comment could carry it — a run of letters,
base64, digits, CJK, a card-like or phone-like run, a sentence without an end — at
two sizes; the time printed is the thread's CPU for the step, and the last column the
ratio of the larger size's time to the smaller's: ~4 for 4x the size when the cost is
linear, ~16 when it is quadratic (what redaction's email pattern, the delimiter guard,
the chunker's cut and the fence's pattern were: 19 s for 160 KB, 5.6 s for 32 KB,
8.4 s for 1 MB, 67 s for 100 KB).

    python bench/hostile_inputs.py [--small 250000] [--large 1000000]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from streams.core.chunking import split_text
from streams.llm.client import unfenced
from streams.pipelines.registry import PipelineRegistry

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def texts(size: int) -> dict[str, str]:
    rng = random.Random(7)
    return {
        "letters": "a" * size,
        "base64": "".join(rng.choice(B64) for _ in range(size)),
        "digits": "1" * size,
        "digits and blanks": "1 " * (size // 2),
        "phone-like": "+1 (555) " * (size // 9),
        "card-like": "4111-" * (size // 5),
        "CJK without an end": "中文评论" * (size // 4),
        "words without an end": "lorem ipsum dolor " * (size // 18),
        "< and blank lines": "<" + " \n" * (size // 2) + "x",
    }


def cpu(step: Callable[[str], object], text: str) -> float:
    start = time.thread_time()
    step(text)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", type=int, default=250_000, help="characters")
    parser.add_argument("--large", type=int, default=1_000_000, help="characters")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    spec = yaml.safe_load((root / "pipelines" / "comment-analysis.yaml").read_text())
    for version_spec in spec["versions"].values():  # as a pipeline that chunks long text
        version_spec["slots"]["text"].pop("max_length", None)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "comment-analysis.yaml").write_text(yaml.safe_dump(spec))
        registry = PipelineRegistry.load(Path(tmp), root / "schemas")
    version = registry.get("comment-analysis").version(None, "t-1")
    small, large = texts(args.small), texts(args.large)
    print(f"CPU seconds per slot at {args.small:,} and {args.large:,} characters, and their "
          f"ratio ({args.large / args.small:.0f} when linear)")  # fmt: skip
    for step, run in (
        ("bind (clean, redact, guard)", lambda text: version.bind({"text": text})),
        ("chunk (3,000 tokens)", lambda text: split_text(text, 3000, 200)),
        ("an answer's fence taken off", lambda text: unfenced("```" + text)),
    ):
        print(f"{step}:")
        run("warm up: the tokenizer's files load at its first use")
        for name in small:
            a, b = cpu(run, small[name]), cpu(run, large[name])
            print(f"  {name:<22} {a:7.3f} s {b:7.3f} s   x{b / max(a, 1e-6):5.1f}")


if __name__ == "__main__":
    main()
