"""The worker's status page (`/status`): a dashboard of its own, no Grafana and no
external assets (one HTML document: inline CSS, charts as inline SVG, no script).

What it shows, from `StatusView.snapshot()`: tiles with the figures an operator asks
first; the last hour as charts (throughput, end-to-end p50/p95, spend per minute,
consumer lag); breakers and limiters at a glance; the latest dead letters with their
category and reason; a panel per prompt version (pass rate as a bar, repairs, cost per
answered task, drift). Numbers are formatted for people (`1.2k`, `340 ms`, `$0.0123`,
`97.5%`); each figure's element carries `data-metric` and its raw `data-value`, so a
test (or a scraper) reads the number the text shows.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

REFRESH_S = 5
PASS_FILL = "#1b8a5a"  # the pass-rate bars' fill (a test measures it in a screenshot)
BAR_TRACK = "#e3e6ea"
BADGE = {"closed": "#2e7d32", "half_open": "#ef6c00", "open": "#c62828"}
DRIFT_THRESHOLD = 0.15  # the LLMStreamsOutputDrift alert's (deploy/prometheus/rules.yml)


def count(x: float | None) -> str:
    """1234 -> 1,234; 12345 -> 12.3k; 2.5e6 -> 2.5M."""
    if x is None:
        return "–"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.1f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def rate(x: float | None) -> str:
    return "–" if x is None else (f"{x:.1f}/s" if x < 100 else f"{count(x)}/s")


def seconds(x: float | None) -> str:
    """0.0123 -> 12 ms; 1.5 -> 1.50 s; 95 -> 1.6 min."""
    if x is None:
        return "–"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    if x < 60:
        return f"{x:.2f} s"
    return f"{x / 60:.1f} min"


def usd(x: float | None) -> str:
    """Dollars with the precision a small amount needs: $12.34, $0.0123, $0.000072."""
    if x is None:
        return "–"
    if x == 0 or abs(x) >= 1:
        return f"${x:,.2f}"
    exponent = int(f"{abs(x):e}".split("e")[1])  # 0.0123 -> -2
    return f"${x:.{min(max(2, 2 - exponent), 8)}f}"  # three significant digits


def pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _e(x: Any) -> str:
    return html.escape(str(x))


def figure(key: str, value: float | None, shown: str, tag: str = "span") -> str:
    raw = "" if value is None else f' data-value="{_e(value)}"'
    return f'<{tag} data-metric="{_e(key)}"{raw}>{_e(shown)}</{tag}>'


def tile(label: str, key: str, value: float | None, fmt: Callable[[float | None], str]) -> str:
    shown = figure(key, value, fmt(value), "div")
    return f'<div class="tile"><div class="k">{_e(label)}</div>{shown}</div>'


def chart(
    title: str, series: list[tuple[str, str, list[tuple[float, float | None]]]],
    fmt: Callable[[float | None], str], key: str,
) -> str:  # fmt: skip
    """A line chart of the last hour: `series` = (name, colour, [(seconds ago, value)])."""
    w, h, left, bottom = 420, 140, 56, 20
    values = [v for _, _, pts in series for _, v in pts if v is not None]
    top = max(values, default=0.0) or 1.0
    lines = []
    for name, colour, pts in series:
        xy = [
            (
                left + (w - left - 8) * (1 - min(ago, 3600) / 3600),
                8 + (h - bottom - 8) * (1 - v / top),
            )
            for ago, v in pts
            if v is not None
        ]
        if xy:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                         f'points="{path}"><title>{_e(name)}</title></polyline>')  # fmt: skip
            # The latest point, marked (a single point draws no line).
            lines.append(f'<circle cx="{xy[-1][0]:.1f}" cy="{xy[-1][1]:.1f}" r="3" '
                         f'fill="{colour}"/>')  # fmt: skip
    legend = " ".join(f'<span style="color:{c}">■ {_e(n)}</span>' for n, c, _ in series)
    last = next((v for _, _, pts in series[:1] for _, v in reversed(pts) if v is not None), None)
    empty = "" if values else (f'<text x="{w / 2}" y="{h / 2}" text-anchor="middle" '
                               'fill="#888">collecting (a point every 10 s)</text>')  # fmt: skip
    return (
        f'<div class="chart"><div class="k">{_e(title)} {figure(key, last, fmt(last))}</div>'
        f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img">'
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - 8}" y2="{h - bottom}" stroke="#bbb"/>'
        f'<text x="{left - 4}" y="14" text-anchor="end" class="ax">{_e(fmt(top))}</text>'
        f'<text x="{left - 4}" y="{h - bottom}" text-anchor="end" class="ax">0</text>'
        f'<text x="{left}" y="{h - 4}" class="ax">−60 min</text>'
        f'<text x="{w - 8}" y="{h - 4}" text-anchor="end" class="ax">now</text>'
        f"{''.join(lines)}{empty}</svg><div class='legend'>{legend}</div></div>"
    )


def _charts(history: list[dict[str, Any]]) -> str:
    def pts(name: str) -> list[tuple[float, float | None]]:
        return [(p["ago_s"], p[name]) for p in history]

    latency = [("p95", "#6a1b9a", pts("e2e_p95_s")), ("p50", "#26a69a", pts("e2e_p50_s"))]
    return "".join([
        chart("Throughput", [("tasks/s", "#1565c0", pts("throughput_per_s"))], rate,
              "chart_throughput"),
        chart("End-to-end latency", latency, seconds, "chart_e2e_p95"),
        chart("Spend", [("USD per minute", "#ef6c00", pts("cost_per_min_usd"))], usd,
              "chart_cost"),
        chart("Consumer lag", [("records", "#c62828", pts("lag"))], count, "chart_lag"),
    ])  # fmt: skip


def _states(snap: dict[str, Any]) -> str:
    badges = [
        f'<span class="badge" style="background:{BADGE.get(state, "#777")}">'
        f"breaker {_e(endpoint)}: {figure(f'breaker_{endpoint}', None, state)}</span>"
        for endpoint, state in snap["breakers"].items()
    ] or ['<span class="badge" style="background:#777">no calls yet</span>']
    limiters = [
        f'<span class="badge" style="background:#455a64">limiter {_e(model)}: '
        f"{figure(f'limiter_{model}', rpm, count(rpm))} RPM</span>"
        for model, rpm in snap["limiter_rpm"].items()
    ]
    caps = [_budget_badge(b) for b in snap.get("budgets", [])]
    return f'<div class="states">{"".join(badges + limiters + caps)}</div>' + _deployments(snap)


def _deployments(snap: dict[str, Any]) -> str:
    """A row per declared deployment: breaker, learned limit, calls by outcome, spend."""
    rows = []
    for d in snap.get("deployments", []):
        name = d["deployment"]
        rows.append(
            f"<tr><td>{_e(name)}</td><td><span class='badge' style='background:"
            f"{BADGE.get(d['breaker'], '#777')}'>{_e(d['breaker'])}</span></td>"
            f"<td>{figure(f'deployment_{name}_rpm', d['rpm'], count(d['rpm']))} RPM</td>"
            f"<td>{count(d['ok'])}</td><td>{count(d['throttled'])}</td>"
            f"<td>{count(d['errors'])}</td>"
            f"<td>{figure(f'deployment_{name}_cost', d['cost_usd'], usd(d['cost_usd']))}</td></tr>"
        )
    if not rows:
        return ""
    return ("<h2>Deployments</h2><table><tr><th>deployment</th><th>breaker</th>"
            "<th>learned limit</th><th>ok</th><th>429</th><th>errors</th><th>spent</th></tr>"
            f"{''.join(rows)}</table>")  # fmt: skip


def _budget_badge(b: dict[str, Any]) -> str:
    """A spend cap: this worker's spend of its share, orange while tasks wait at it."""
    name = f"budget_{b['pipeline']}_{b['lane']}_{b['window']}"
    waiting = f" · {b['waiting']} waiting" if b["waiting"] else ""
    return (f'<span class="badge" style="background:{"#ef6c00" if waiting else "#455a64"}">'
            f"budget {_e(b['pipeline'])} {_e(b['lane'])}/{_e(b['window'])}: "
            f"{figure(name, b['spent_usd'], usd(b['spent_usd']))} of {usd(b['cap_usd'])}"
            f"{waiting}</span>")  # fmt: skip


def _dead_letters(snap: dict[str, Any]) -> str:
    by_category = " · ".join(
        f"{_e(k)} {figure(f'dlq_{k}', v, count(v))}"
        for k, v in snap["dead_letters_by_category"].items()
    )
    rows = "".join(
        f"<tr><td>{_e(time.strftime('%H:%M:%S', time.localtime(d['at'])))}</td>"
        f"<td>{_e(d.get('task_id') or '–')}</td><td><b>{_e(d.get('category'))}</b> "
        f"{_e(d.get('code') or '')}</td><td class='msg'>{_e(d.get('message') or '')}</td></tr>"
        for d in snap.get("recent_dead_letters", [])
    )
    table = (f"<table><tr><th>at</th><th>task</th><th>category</th><th>reason</th></tr>"
             f"{rows}</table>" if rows else "<p class='k'>none yet</p>")  # fmt: skip
    return f"<h2>Latest dead letters</h2><p>{by_category or ''}</p>{table}"


def _versions(snap: dict[str, Any]) -> str:
    panels = []
    for v in snap.get("versions", []):
        name = f"{v['pipeline']}/{v['version']}"
        at = f"version:{name}"

        def row(label: str, key: str, fmt: Callable[[float | None], str], v: Any = v) -> str:
            shown = figure(f"version:{v['pipeline']}/{v['version']}:{key}", v[key], fmt(v[key]))
            return f"<tr><th>{_e(label)}</th><td>{shown}</td></tr>"

        passed = v["pass_rate"]
        width = 0.0 if passed is None else passed * 100
        lat = v["latency_s"]
        drift = v.get("drift")
        drifted = drift is not None and drift["divergence"] > DRIFT_THRESHOLD
        drift_text = (
            "no baseline" if drift is None else f"{drift['divergence']:.3f} ({drift['field']})"
        )
        drift_value = None if drift is None else drift["divergence"]
        panels.append("".join([
            f'<div class="version"><h3>{_e(name)}</h3><div class="k">content pass rate ',
            figure(f"{at}:pass_rate", passed, pct(passed)), "</div>",
            f'<div class="bar" style="background:{BAR_TRACK}">',
            f'<div style="width:{width:.2f}%;background:{PASS_FILL}"></div></div><table>',
            row("tasks", "tasks", count), row("repaired", "repair_rate", pct),
            row("dead letters", "dead_letter_rate", pct),
            row("sent to review", "review_share", pct),
            "<tr><th>task time p50 / p95</th><td>",
            figure(f"{at}:p50", lat["p50"], seconds(lat["p50"])), " / ",
            figure(f"{at}:p95", lat["p95"], seconds(lat["p95"])), "</td></tr>",
            row("cost per answered task", "cost_per_accepted_usd", usd),
            row("tokens per answered task", "tokens_per_accepted", count),
            f"<tr><th>drift</th><td class='{'warn' if drifted else ''}'>",
            figure(f"{at}:drift", drift_value, drift_text), "</td></tr></table></div>",
        ]))  # fmt: skip
    if not panels:
        return ""
    return f"<h2>Prompt versions</h2><div class='versions'>{''.join(panels)}</div>"


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafbfc}
h1{font-size:20px;margin:0 0 .6em} h2{font-size:16px;margin:1.4em 0 .5em}
h3{margin:0 0 .4em;font-size:15px}
.tiles{display:flex;flex-wrap:wrap;gap:10px}
.tile{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px 12px;min-width:120px}
.tile div[data-metric]{font-size:22px;font-weight:600}
.k{color:#666;font-size:12px} .charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px}
.ax{font-size:10px;fill:#777} .legend{font-size:12px}
.badge{display:inline-block;color:#fff;border-radius:12px;padding:3px 10px;margin:2px}
table{border-collapse:collapse;background:#fff}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
.msg{max-width:640px;font-family:monospace;font-size:12px}
.versions{display:flex;flex-wrap:wrap;gap:12px}
.version{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px;width:340px}
.bar{width:300px;height:14px;border-radius:3px;overflow:hidden;margin:4px 0 8px}
.bar div{height:14px} .warn{color:#c62828;font-weight:600}
"""


def render_html(snap: dict[str, Any], refresh_s: int = REFRESH_S) -> str:
    """The snapshot as a page that refreshes itself every `refresh_s`."""
    t = snap["tasks"]
    e2e = snap["end_to_end_s"]
    tiles = "".join([
        tile("throughput", "throughput_per_s", snap["throughput_per_s"], rate),
        tile("tasks received", "received", t["received"], count),
        tile("results", "results", t["results"], count),
        tile("dead letters", "dead_letters", t["dead_letters"], count),
        tile("in flight", "in_flight", t["in_flight"], count),
        tile("consumer lag", "lag", snap["lag"], count),
        tile("paused partitions", "paused_partitions", snap["paused_partitions"], count),
        *(tile(f"end-to-end {k}", f"e2e_{k}", v, seconds) for k, v in e2e.items()),
        tile("spent so far", "cost_usd", snap["cost_usd"], usd),
        tile("cost per result", "cost_per_result_usd", snap["cost_per_result_usd"], usd),
    ])  # fmt: skip
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{refresh_s}'><title>llm-streams status</title>"
        f"<style>{STYLE}</style></head><body><h1>llm-streams worker</h1>"
        f"<div class='tiles'>{tiles}</div>{_states(snap)}"
        f"<h2>Last hour</h2><div class='charts'>{_charts(snap.get('history', []))}</div>"
        f"{_versions(snap)}{_dead_letters(snap)}</body></html>"
    )


__all__ = ["count", "pct", "render_html", "seconds", "usd"]
