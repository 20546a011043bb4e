"""The worker's status page (`/status`): a dashboard of its own, no Grafana and no
external assets (one HTML document: inline CSS, charts as inline SVG, and one small
script that fetches the page again every few seconds and swaps its body, so it updates
in place without a reload; without scripts, a meta refresh does it).

What it shows, from `StatusView.snapshot()`: who the worker is (host, group, version,
uptime, partitions, model, endpoint); tiles with the figures an operator asks first, each
saying its window; the LLM's calls, 429s, errors and retries by category since start;
breakers with the time they took their state and what to do when one is open; per lane
and per deployment rows; the recent past as charts whose time axis fits the history
kept (throughput, end-to-end p50/p95, spend per minute, consumer lag); the latest dead
letters; a panel per prompt version (pass rate as a bar, repairs, cost per answered
task, drift). Numbers are formatted for people (`1.2k`, `340 ms`, `$0.0123`, `97.5%`);
each figure's element carries `data-metric` and its raw `data-value`, so a test (or a
scraper) reads the number the text shows. It reads at phone width: tiles and charts
wrap, charts scale, wide tables scroll inside their box.
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
    """A line chart of the history kept: `series` = (name, colour, [(seconds ago, value)]).
    Its time axis spans the oldest point (at least a minute, at most the hour kept)."""
    w, h, left, bottom = 420, 140, 56, 20
    values = [v for _, _, pts in series for _, v in pts if v is not None]
    top = max(values, default=0.0) or 1.0
    span = min(max([ago for _, _, pts in series for ago, _ in pts] + [60.0]), 3600.0)
    lines = []
    for name, colour, pts in series:
        xy = [
            (
                left + (w - left - 8) * (1 - min(ago, span) / span),
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
        f'<svg viewBox="0 0 {w} {h}" role="img" data-span-s="{span:.0f}">'
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - 8}" y2="{h - bottom}" stroke="#bbb"/>'
        f'<text x="{left - 4}" y="14" text-anchor="end" class="ax">{_e(fmt(top))}</text>'
        f'<text x="{left - 4}" y="{h - bottom}" text-anchor="end" class="ax">0</text>'
        f'<text x="{left}" y="{h - 4}" class="ax">−{_e(ago_label(span))}</text>'
        f'<text x="{w - 8}" y="{h - 4}" text-anchor="end" class="ax">now</text>'
        f"{''.join(lines)}{empty}</svg><div class='legend'>{legend}</div></div>"
    )


def ago_label(seconds_ago: float) -> str:
    """60 -> 1 min; 600 -> 10 min; 3600 -> 60 min; 30 -> 30 s."""
    return f"{seconds_ago:.0f} s" if seconds_ago < 60 else f"{seconds_ago / 60:.0f} min"


def _charts(history: list[dict[str, Any]]) -> str:
    def pts(name: str) -> list[tuple[float, float | None]]:
        return [(p["ago_s"], p[name]) for p in history]

    latency = [("p95", "#6a1b9a", pts("e2e_p95_s")), ("p50", "#26a69a", pts("e2e_p50_s"))]
    return "".join([
        chart("Throughput, tasks/s per 10 s", [("tasks/s", "#1565c0", pts("throughput_per_s"))],
              rate, "chart_throughput"),
        chart("End-to-end p95 / p50 per 10 s", latency, seconds, "chart_e2e_p95"),
        chart("Spend, USD per minute", [("USD per minute", "#ef6c00", pts("cost_per_min_usd"))],
              usd, "chart_cost"),
        chart("Consumer lag, records", [("records", "#c62828", pts("lag"))], count,
              "chart_lag"),
    ])  # fmt: skip


HINT = {
    "open": "its calls are refused while it fails; tasks wait for it, none is lost. Check "
    "the endpoint (its status page, the key, the quota, the worker's log for the errors "
    "above); the breaker lets a call through after its open time and closes when calls "
    "pass. Runbook: docs/OPERATIONS.md#llmstreamsbreakeropen",
    "half_open": "trying a few calls to see whether it is back; it closes when they pass",
}


def since(at: float | None, now: float) -> str:
    if at is None:
        return ""
    clock = time.strftime("%H:%M:%S", time.localtime(at))
    return f" since {clock} ({seconds(max(now - at, 0.0))})"


def _states(snap: dict[str, Any]) -> str:
    now = time.time()
    at = snap.get("breaker_since", {})
    badges = [
        f'<span class="badge" style="background:{BADGE.get(state, "#777")}">'
        f"breaker {_e(endpoint)}: {figure(f'breaker_{endpoint}', None, state)}"
        f"{_e(since(at.get(endpoint), now))}</span>"
        for endpoint, state in snap["breakers"].items()
    ] or ['<span class="badge" style="background:#777">no calls yet</span>']
    hints = "".join(
        f"<p class='hint' data-metric='hint_{_e(endpoint)}'><b>{_e(endpoint)}</b> is "
        f"{_e(state.replace('_', '-'))}: {_e(HINT[state])}</p>"
        for endpoint, state in snap["breakers"].items() if state in HINT
    )  # fmt: skip
    limiters = [
        f'<span class="badge" style="background:#455a64">limiter {_e(model)}: '
        f"{figure(f'limiter_{model}', rpm, count(rpm))} RPM</span>"
        for model, rpm in snap["limiter_rpm"].items()
    ]
    caps = [_budget_badge(b) for b in snap.get("budgets", [])]
    return (f'<div class="states">{"".join(badges + limiters + caps)}</div>{hints}'
            f"{_llm(snap)}{_lanes(snap)}{_deployments(snap)}")  # fmt: skip


def _llm(snap: dict[str, Any]) -> str:
    """The LLM's side since start: answered calls, 429s, errors and retries by category."""
    llm = snap.get("llm")
    if not llm:
        return ""

    def by(kind: str) -> str:
        return " · ".join(f"{_e(k)} {figure(f'llm_{kind}_{k}', v, count(v))}"
                          for k, v in llm[kind].items()) or "none"  # fmt: skip

    return ("<h2>LLM calls <span class='k'>since start</span></h2><p>"
            f"answered {figure('llm_ok', llm['ok'], count(llm['ok']))} · "
            f"429 {figure('llm_rate_limited', llm['rate_limited'], count(llm['rate_limited']))}"
            f"</p><p>errors by category: {by('errors')}</p>"
            f"<p>retries by cause: {by('retries')}</p>")  # fmt: skip


def _lanes(snap: dict[str, Any]) -> str:
    body = []
    for r in snap.get("lanes", []):
        lane = r["lane"]
        cells = [figure(f"lane_{lane}_{k}", r[k], count(r[k]))
                 for k in ("received", "results", "dead_letters")]  # fmt: skip
        cells.append(figure(f"lane_{lane}_p95", r["e2e_p95_s"], seconds(r["e2e_p95_s"])))
        body.append(f"<tr><td>{_e(lane)}</td>{''.join(f'<td>{c}</td>' for c in cells)}</tr>")
    if not body:
        return ""
    return ("<h2>Lanes <span class='k'>since start</span></h2><div class='scroll'><table>"
            "<tr><th>lane</th><th>received</th><th>results</th><th>dead letters</th>"
            f"<th>end-to-end p95</th></tr>{''.join(body)}</table></div>")  # fmt: skip


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
    return ("<h2>Deployments <span class='k'>calls and spend since start</span></h2>"
            "<div class='scroll'><table><tr><th>deployment</th><th>breaker</th>"
            "<th>learned limit</th><th>ok</th><th>429</th><th>errors</th><th>spent</th></tr>"
            f"{''.join(rows)}</table></div>")  # fmt: skip


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
    table = (f"<div class='scroll'><table><tr><th>at</th><th>task</th><th>category</th>"
             f"<th>reason</th></tr>{rows}</table></div>" if rows
             else "<p class='k'>none yet</p>")  # fmt: skip
    return (f"<h2>Latest dead letters</h2><p>{'since start: ' + by_category if by_category else ''}"
            f"</p>{table}")  # fmt: skip


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
h1{font-size:20px;margin:0 0 .2em} h2{font-size:16px;margin:1.4em 0 .5em}
h3{margin:0 0 .4em;font-size:15px} .who{color:#555;font-size:12px;margin:0 0 .8em}
.tiles{display:flex;flex-wrap:wrap;gap:10px}
.tile{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px 12px;min-width:120px}
.tile div[data-metric]{font-size:22px;font-weight:600}
.k{color:#666;font-size:12px;font-weight:normal} .charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px;width:420px;
max-width:100%;box-sizing:border-box} .chart svg{width:100%;height:auto;display:block}
.ax{font-size:10px;fill:#777} .legend{font-size:12px}
.badge{display:inline-block;color:#fff;border-radius:12px;padding:3px 10px;margin:2px}
.hint{background:#fff4e5;border-left:4px solid #ef6c00;padding:6px 10px;max-width:760px}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;background:#fff}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
.msg{max-width:640px;font-family:monospace;font-size:12px;overflow-wrap:anywhere}
.versions{display:flex;flex-wrap:wrap;gap:12px}
.version{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px;width:340px;
max-width:100%;box-sizing:border-box}
.bar{width:300px;max-width:100%;height:14px;border-radius:3px;overflow:hidden;margin:4px 0 8px}
.bar div{height:14px} .warn{color:#c62828;font-weight:600}
@media (max-width:600px){body{margin:.6em} .tile{min-width:0;flex:1 1 40%}
.tile div[data-metric]{font-size:18px}}
"""

# Fetches the page again every `refresh_s` and swaps its body: figures update in place,
# the scroll position stays, and a failed fetch (worker restarting) leaves the last view
# with a note rather than an error page.
SCRIPT = """
(function(){var every=%d*1000;document.documentElement.dataset.live="1";
function tick(){fetch(location.href,{cache:"no-store"}).then(function(r){
if(!r.ok)throw new Error(r.status);return r.text();}).then(function(t){
var d=new DOMParser().parseFromString(t,"text/html");
document.body.innerHTML=d.body.innerHTML;}).catch(function(){
var n=document.getElementById("stale");
if(n)n.textContent="(not updating: the worker does not answer)";
}).finally(function(){setTimeout(tick,every);});}
setTimeout(tick,every);})();
"""


def _who(snap: dict[str, Any]) -> str:
    """Who the worker is, in one line under the title."""
    w = snap.get("worker") or {}
    parts = [
        ("host", w.get("host")), ("group", w.get("app_id")), ("version", w.get("version")),
        ("up", seconds(w["uptime_s"]) if "uptime_s" in w else None),
        ("partitions", ",".join(map(str, w["partitions"])) if w.get("partitions") else
         ("none" if "partitions" in w else None)),
        ("model", w.get("model")), ("endpoint", w.get("endpoint")),
        ("pipelines", ", ".join(w["pipelines"]) if w.get("pipelines") else None),
        ("guarantee", w.get("guarantee")),
    ]  # fmt: skip
    shown = " · ".join(f"{k} <b data-metric='worker_{k}'>{_e(v)}</b>" for k, v in parts if v)
    return f"<p class='who'>{shown} <span id='stale'></span></p>"


def render_html(snap: dict[str, Any], refresh_s: int = REFRESH_S) -> str:
    """The snapshot as a page that updates itself every `refresh_s`."""
    t = snap["tasks"]
    e2e = snap["end_to_end_s"]
    window = snap.get("throughput_window_s")
    over = f" (last {seconds(window)})" if window else ""
    tiles = "".join([
        tile(f"throughput{over}", "throughput_per_s", snap["throughput_per_s"], rate),
        tile("tasks received", "received", t["received"], count),
        tile("results", "results", t["results"], count),
        tile("dead letters", "dead_letters", t["dead_letters"], count),
        tile("in flight now", "in_flight", t["in_flight"], count),
        tile("consumer lag now", "lag", snap["lag"], count),
        tile("paused partitions", "paused_partitions", snap["paused_partitions"], count),
        *(tile(f"end-to-end {k} since start", f"e2e_{k}", v, seconds) for k, v in e2e.items()),
        tile("spent since start", "cost_usd", snap["cost_usd"], usd),
        tile("cost per result", "cost_per_result_usd", snap["cost_per_result_usd"], usd),
    ])  # fmt: skip
    kept = max((p["ago_s"] for p in snap.get("history", [])), default=0.0)
    recent = f"Last {ago_label(min(max(kept, 60.0), 3600.0))}"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<noscript><meta http-equiv='refresh' content='{refresh_s}'></noscript>"
        f"<title>llm-streams status</title><style>{STYLE}</style>"
        f"<script>{SCRIPT % refresh_s}</script></head><body><h1>llm-streams worker</h1>"
        f"{_who(snap)}<div class='tiles'>{tiles}</div>{_states(snap)}"
        f"<h2>{recent} <span class='k'>a point every 10 s</span></h2>"
        f"<div class='charts'>{_charts(snap.get('history', []))}</div>"
        f"{_versions(snap)}{_dead_letters(snap)}</body></html>"
    )


__all__ = ["ago_label", "count", "pct", "render_html", "seconds", "since", "usd"]
