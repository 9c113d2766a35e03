"""The tuning table both engines print (ResNetEncoder.tune, FusedMLP.tune, kfuse tune, the benchmarks): rows as the
binding's report dicts (python/src/tuning_report_dict.h), times in ms."""

from __future__ import annotations

__all__ = ["format_tuning_table", "tuning_verdict"]


def format_tuning_table(rows: list[dict]) -> str:
    """The tuning table: per op the default kernel's time, cuDNN's best candidate, the tuned time, the spread and the
    choice (times in us; '-' where unknown: cached rows have no cuDNN time, ops without a cuDNN candidate none)."""
    def ms(v):
        return "-" if v is None or v != v else f"{v * 1e3:8.1f}"
    lines = [f"{'op':<26} {'shape':<34} {'default us':>10} {'cudnn us':>9} {'tuned us':>9} {'spread':>7}  choice"]
    for r in rows:
        src = " (cached)" if r.get("from_cache") else ""
        lines.append(f"{r['op']:<26} {r['shape']:<34} {ms(r['default_ms']):>10} {ms(r.get('cudnn_ms')):>9} "
                     f"{ms(r['tuned_ms']):>9} {ms(r['spread_ms']):>7}  {r['choice']}{src}")
    return "\n".join(lines)


def tuning_verdict(rows: list[dict]) -> str:
    """One line on the rows timed in this run: how much faster each tuned choice is than the heuristic default and
    than cuDNN's best candidate (median times of the same interleaved measurement). The choice is the fastest median
    among the accepted candidates, default and cuDNN included, so it is never slower than either: what the line
    adds is the margins, and it names any row where that would not hold (a rejected default, a missing time)."""
    def num(v):
        return v if isinstance(v, (int, float)) and v == v else None

    timed = [r for r in rows if not r.get("from_cache") and num(r.get("tuned_ms"))]
    vs_default = [num(r.get("default_ms")) / r["tuned_ms"] for r in timed if num(r.get("default_ms"))]
    vs_cudnn = [num(r.get("cudnn_ms")) / r["tuned_ms"] for r in timed if num(r.get("cudnn_ms"))]
    slow = []
    for r in timed:
        tol = num(r.get("spread_ms")) or 0.0
        for what in ("default_ms", "cudnn_ms"):
            other = num(r.get(what))
            if other is not None and r["tuned_ms"] > other + tol:
                slow.append(f"{r['op']} {r['shape']}: tuned {r['tuned_ms'] * 1e3:.1f} us > {what[:-3]} "
                            f"{other * 1e3:.1f} us")

    def span(v):
        return f"{min(v):.2f}-{max(v):.2f}x" if v else "-"
    head = (f"{len(timed)} ops timed ({len(vs_cudnn)} with cuDNN candidates): tuned vs default {span(vs_default)}, "
            f"vs cuDNN's best {span(vs_cudnn)}; "
            f"{'never slower than either (within spread)' if not slow else f'{len(slow)} slower'}")
    return "\n".join([head] + ["  " + s for s in slow])
