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


def size(n: float, sep: str = " ") -> str:
    """Bytes in binary units: 512 B, 4.0 KiB, 12.5 MiB (``sep`` between number and unit:
    ``spanprof explain``/``top`` print none)."""
    a = abs(n)
    for unit, step in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if a >= step:
            return f"{n / step:.1f}{sep}{unit}"
    return f"{n:.0f}{sep}B"


def _fig(f: dict[str, Any]) -> str:
    """Mean per call, its interval and the few-calls mark (time, or bytes)."""
    unit, show = ("bytes", size) if "per_call_bytes" in f else ("ns", _ms)
    out = show(f[f"per_call_{unit}"])
    if f.get(f"ci_{unit}") is not None:
        out += f" ±{show(f[f'ci_{unit}'])}"
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
    # where contention or allocation profiles reached the spans
    for name, label, unit in (("lock", "lock wait", "ns"), ("alloc", "allocated", "bytes")):
        if name in t and (t[name][f"per_call_{unit}"] or g[name][f"per_call_{unit}"]):
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
                       ("wall_functions", "wall time per call (wall-clock profile)"),
                       ("lock_functions", "lock wait per call (contention profile)"),
                       ("alloc_functions", "bytes allocated per call")):
        if not d.get(key):
            continue
        unit, show = ("bytes", size) if key == "alloc_functions" else ("ns", _ms)
        lines.append("")
        lines.append(f"functions by {title}, tail - typical"
                     + (" (share of the extra duration)" if unit == "ns" else ""))
        for f in d[key]:
            explains = f"{f['explains']:6.0%}" if f["explains"] is not None else "     -"
            ci = f" ±{show(f[f'ci_{unit}'])}" if f[f"ci_{unit}"] is not None else ""
            dv = f[f"delta_{unit}"]
            delta = ('+' if dv >= 0 else '-') + show(abs(dv))
            lines.append(f"  {delta:>10}{ci:<12}"
                         f"{explains}  {f['name']}  (tail {show(f['tail'][f'per_call_{unit}'])}, "
                         f"typical {show(f['typical'][f'per_call_{unit}'])})"
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
