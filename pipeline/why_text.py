"""``spanprof why``'s answer for a terminal, and as a differential flame graph (SVG).

The data is the admin API's ``/api/v1/why`` (pipeline/admin/why.py). A figure standing on
too few calls to trust is printed with a ``?`` and its interval.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pipeline import flamegraph


def _ms(ns: float) -> str:
    a = abs(ns)
    if a >= 10e9:
        return f"{ns / 1e9:.1f} s"
    if a >= 1e9:
        return f"{ns / 1e9:.2f} s"
    return f"{ns / 1e6:.1f} ms"


def _fig(f: dict[str, Any]) -> str:
    """Mean per call, its interval and the few-calls mark."""
    out = _ms(f["per_call_ns"])
    if f.get("ci_ns") is not None:
        out += f" ±{_ms(f['ci_ns'])}"
    return out + (" ?" if f.get("few") else "")


def _when(s: int) -> str:
    return datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%d %H:%M")


def text(d: dict[str, Any]) -> str:
    lines = [f"why {d['service']} / {d['operation']}, {_when(d['from'])}..{_when(d['to'])} "
             f"UTC: {d['calls']} calls; tail: {d['rule']}"
             + (f" (>= {_ms(d['threshold_ns'])})" if d.get("threshold_ns") else "")]
    if d["tail"] is None:
        lines.append(f"{d['verdict']}: " + "; ".join(d["notes"]))
        return "\n".join(lines) + "\n"
    t, g = d["tail"], d["typical"]
    lines.append(f"{'per call':16}  {'tail (' + str(t['calls']) + ')':>26}  "
                 f"{'typical (' + str(g['calls']) + ')':>26}")
    for name, label in (("duration", "duration"), ("inclusive_cpu", "CPU with children"),
                        ("cpu", "CPU of the span"), ("off_cpu", "off-CPU")):
        lines.append(f"{label:16}  {_fig(t[name]):>26}  {_fig(g[name]):>26}")
    lines.append(f"samples          {t['samples']:>26}  {g['samples']:>26}")
    extra = d["extra_ns"]
    if d["verdict"] == "not slower":
        lines.append("the tail is not slower than the typical calls")
    else:
        share = d["extra_cpu_ns"] / extra if extra else 0.0
        lines.append(f"the tail takes {_ms(extra)} more per call: {d['verdict']} "
                     f"(CPU {_ms(d['extra_cpu_ns'])}, {share:.0%} of it; off-CPU "
                     f"{_ms(d['extra_off_cpu_ns'])})")
    for key, title in (("functions", "self CPU per call"),
                       ("wall_functions", "wall time per call (wall-clock profile)")):
        if not d.get(key):
            continue
        lines.append("")
        lines.append(f"functions by {title}, tail - typical (share of the extra duration)")
        for f in d[key]:
            explains = f"{f['explains']:6.0%}" if f["explains"] is not None else "     -"
            ci = f" ±{_ms(f['ci_ns'])}" if f["ci_ns"] is not None else ""
            delta = ('+' if f['delta_ns'] >= 0 else '-') + _ms(abs(f['delta_ns']))
            lines.append(f"  {delta:>10}{ci:<12}"
                         f"{explains}  {f['name']}  (tail {_ms(f['tail']['per_call_ns'])}, "
                         f"typical {_ms(f['typical']['per_call_ns'])})"
                         + (" ?" if f["few"] else ""))
    if d.get("attributes"):
        lines.append("")
        lines.append("attributes that set the tail apart (separation 0..1)")
        for a in d["attributes"][:10]:
            if a["kind"] == "numeric":
                what = f"mean {a['tail']['mean']:.4g} in the tail, {a['typical']['mean']:.4g} " \
                       "typical"
            else:
                what = f"= {a['value']!r} in {a['tail']['share']:.0%} of the tail, " \
                       f"{a['typical']['share']:.0%} typical"
            lines.append(f"  {a['separation']:.2f}  {a['key']}: {what}"
                         + (" ?" if a["few"] else ""))
    if d["notes"]:
        lines.append("")
        lines.extend(f"note: {n}" for n in d["notes"])
    lines.append("(? : too few calls to trust; ± : 95% interval of the mean per call)")
    return "\n".join(lines) + "\n"


def svg(d: dict[str, Any]) -> str:
    """The tail's stacks per call, coloured by their difference with the typical calls'."""
    stacks = d.get("stacks") or []
    tail = flamegraph.build((s["frames"], round(s["tail_ns"])) for s in stacks)
    base = flamegraph.build((s["frames"], round(s["typical_ns"])) for s in stacks)
    title = (f"{d['service']} / {d['operation']}: CPU per call of the tail ({d['rule']}), "
             "red: more than typical, blue: less")
    return flamegraph.render_svg(tail, title, base=base)
