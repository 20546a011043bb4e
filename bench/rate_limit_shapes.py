"""Rate limits of every shape: how much of the binding limit one worker turns into
answers, whatever the provider's enforcement and header style, learned (never told).

One run, one broker (Apache Kafka 4.1.1 from jars), one LLM simulator process
(latency 300 +- 100 ms, 1% 500s), one llm-streams worker with no limit configured.
Phases, each against the simulator set to one provider shape:

1. RPM, refilled per second with a one-second burst; `remaining` counted against the
   minute (OpenAI's headers);
2. the same limit with `remaining` counted against the enforcing second (some
   gateways and providers);
3. RPM as a fixed one-minute window (reset at each minute's end); `remaining` of the
   window;
4. a TPM limit that binds before RPM (per-second refill), `remaining` per minute;
5. the same TPM limit, `remaining` counted against the enforcing second;
6. the RPM of phase 1 with no `x-ratelimit-*` headers at all: only 429s with
   `Retry-After` (a provider that enforces a limit and says nothing of it);
7. phase 1's RPM said in Anthropic's headers (`anthropic-ratelimit-*`, the reset an
   RFC 3339 time to the second);
8. phase 4's TPM said in Cerebras' headers (`x-ratelimit-*-tokens-minute`; its
   requests as a per-day quota, the per-minute request limit enforced, not said);
9. and 10. phases 1 and 4 in Azure OpenAI's headers: `remaining` of requests and
   tokens alone, no limit and no reset said; its 429s worded "exceeded call rate limit"
   or "token rate limit";
11. phase 1's RPM in Groq's headers: OpenAI's names, the request ones a day's quota;
    the per-minute request limit said in its 429s' words alone ("on requests per
    minute (RPM): Limit ...");
12. phase 1's RPM in Cerebras' headers: its token limit said (not binding), its request
    limit named in its 429s alone ("Requests per minute limit exceeded");
13. phase 1's RPM said by an API gateway as Envoy says it (IETF draft 3:
    `x-ratelimit-limit: R, R;w=60`, `x-ratelimit-remaining` of the minute, the reset in
    whole seconds), no token headers, its 429s "API rate limit exceeded";
14. the same gateway as Kong says it, per second (`X-RateLimit-Limit-Second: R/60`,
    `remaining` of the second, `RateLimit-Reset`);
15. phase 1's RPM in Mistral's headers (`x-ratelimit-limit-req-minute`, the token
    limit said as `-tokens-minute` (not binding), monthly quotas beside them, no reset),
    its 429s "Rate limit exceeded" (`rate_limited`, code 1300), naming no limit.

Each style's 429s are worded as that provider words them (`dev.sim_limits.refusal`).

Printed per phase: what admitted requests took of the binding limit per minute over
the busy span (requests, or the tokens the provider charged: prompt + max_tokens),
the same over the steady middle 80% of the busy seconds (requests only), and the
share of requests answered 429.

    python bench/rate_limit_shapes.py [--rpm 3000] [--tasks 3000] [--phases 1,2,...,15]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import stop, warm_up
from rate_limit_utilisation import DEAD_LETTERS, Sim, figures, run_workers

from streams.dev.brokers.apache import ApacheKafka

# (name, simulator knobs, binding limit, tasks as a multiple of --tasks)
PHASES: dict[int, tuple[str, dict[str, Any], str, float]] = {
    1: ("RPM per second, remaining/minute", {"limit_shape": "bucket",
                                             "remaining_window_s": 60.0}, "rpm", 1.0),
    2: ("RPM per second, remaining/second", {"limit_shape": "bucket",
                                             "remaining_window_s": 1.0}, "rpm", 1.0),
    3: ("RPM fixed 1-minute window", {"limit_shape": "window", "window_s": 60.0,
                                      "remaining_window_s": 60.0}, "rpm", 2.0),
    4: ("TPM binds, remaining/minute", {"limit_shape": "bucket",
                                        "remaining_window_s": 60.0}, "tpm", 0.5),
    5: ("TPM binds, remaining/second", {"limit_shape": "bucket",
                                        "remaining_window_s": 1.0}, "tpm", 0.5),
    6: ("RPM per second, no rate headers", {"limit_shape": "bucket", "rate_headers": False},
        "rpm", 1.0),
    7: ("RPM per second, Anthropic's headers", {"limit_shape": "bucket",
        "remaining_window_s": 60.0, "header_style": "anthropic"}, "rpm", 1.0),
    8: ("TPM binds, Cerebras' headers", {"limit_shape": "bucket",
        "remaining_window_s": 60.0, "header_style": "cerebras"}, "tpm", 0.5),
    9: ("RPM per second, Azure's headers", {"limit_shape": "bucket",
        "remaining_window_s": 60.0, "header_style": "azure"}, "rpm", 1.0),
    10: ("TPM binds, Azure's headers", {"limit_shape": "bucket",
         "remaining_window_s": 60.0, "header_style": "azure"}, "tpm", 0.5),
    11: ("RPM per second, Groq's headers", {"limit_shape": "bucket",
         "remaining_window_s": 60.0, "header_style": "groq"}, "rpm", 1.0),
    12: ("RPM per second, Cerebras' headers", {"limit_shape": "bucket",
         "remaining_window_s": 60.0, "header_style": "cerebras"}, "rpm", 1.0),
    13: ("RPM per second, Envoy gateway's", {"limit_shape": "bucket",
         "remaining_window_s": 60.0, "header_style": "envoy"}, "rpm", 1.0),
    14: ("RPM per second, Kong's per second", {"limit_shape": "bucket",
         "remaining_window_s": 1.0, "header_style": "kong"}, "rpm", 1.0),
    15: ("RPM per second, Mistral's headers", {"limit_shape": "bucket",
         "remaining_window_s": 60.0, "header_style": "mistral"}, "rpm", 1.0),
}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--phases", default=",".join(str(p) for p in PHASES))
    args = parser.parse_args()
    rpm = args.rpm
    loose_tpm = rpm * 2000  # RPM binds: far more tokens than RPM x the ~700 charged a call
    tight_tpm = rpm * 350  # TPM binds at about half the RPM
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-shapes-"))
    sim = Sim(rpm, loose_tpm)
    rows = []
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            for phase in (int(p) for p in args.phases.split(",")):
                name, knobs, binding, share = PHASES[phase]
                tpm = tight_tpm if binding == "tpm" else loose_tpm
                sim.call("/sim/config", {"rate_headers": True, "header_style": "openai",
                                         **knobs, "tpm": tpm})  # fmt: skip
                sim.reset(rpm)
                n = int(args.tasks * share)
                span = await run_workers(kafka, sim, n, 1, logdir)
                stats = sim.call("/sim/stats")
                util, steady, refused = figures(stats, rpm, span)
                if binding == "tpm":
                    util = stats["charged_tokens"] / span * 60 / tpm
                    steady = float("nan")
                rows.append((name, binding.upper(), util, steady, refused, n))
    finally:
        stop(sim.proc)
    print(f"simulator: RPM R={rpm}, TPM {loose_tpm} (RPM binds) or {tight_tpm} (TPM binds); "
          "latency 300+-100 ms, 1% 500s; one worker, limits learned")  # fmt: skip
    print(f"{'shape':<36} {'binds':>5} {'used / limit':>12} {'steady':>7} {'429 share':>10} "
          f"{'tasks':>6}")  # fmt: skip
    for name, binding, util, steady, refused, n in rows:
        print(f"{name:<36} {binding:>5} {util:>12.3f} {steady:>7.3f} {refused:>9.2%} {n:>6}")
    print(f"dead letters by code: {dict(DEAD_LETTERS) or 'none'}")
    print(f"logs: {logdir}")


if __name__ == "__main__":
    asyncio.run(main())
