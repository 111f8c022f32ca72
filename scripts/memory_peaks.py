"""What is alive on the GPU at a step's start and at its peak: replays the CUDA allocator's trace recorded by
``scripts/bench_step.py --memory-snapshot PATH`` (every step of a case, from before its first) and lists the
live allocations grouped by where they were made (the innermost frame in the package, else in a library).

    python scripts/bench_step.py --suite smollm2 --cases smollm2_grpo_checkpointing --memory-snapshot /tmp/m
    python scripts/memory_peaks.py /tmp/m.smollm2_grpo_checkpointing.pkl --top 15

Prints, for the last step: what was alive when it started (what earlier steps left behind), and its highest
point; then the sites whose live bytes grew from the first step's start to the last's (a leak shows there).
Memory allocated before the trace started (the weights, the optimiser's state) is one line, ``before the trace``.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from typing import Optional

GIB = 2**30
MARK = "step_start_mark"  # the name of the frame bench_step.py allocates its per-step marker in


def _where(frames: list[dict]) -> str:
    named = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in named:
        if "scgrpo" in f["filename"] and "bench_step" not in f["filename"]:
            return f"{f['filename'].split('scgrpo/')[-1]}:{f['line']} {f['name']}"
    return f"{named[0]['filename'].split('/')[-1]}:{named[0]['line']} {named[0]['name']}" if named else "(no frames)"


def _is_mark(event: dict) -> bool:
    return event["action"] == "alloc" and any(f.get("name") == MARK for f in event.get("frames", []))


def replay(events: list[dict], base: int):
    """Yields (index, event, live bytes after it, live blocks) over the trace."""
    live: dict[int, dict] = {}
    total = base
    for i, event in enumerate(events):
        action, addr = event["action"], event["addr"]
        if action == "alloc":
            live[addr] = event
            total += event["size"]
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)["size"]
        elif action in ("segment_free", "segment_unmap"):
            for a in [a for a in live if addr <= a < addr + event["size"]]:
                total -= live.pop(a)["size"]
        yield i, event, total, live


def by_site(blocks) -> list[tuple[str, int]]:
    groups: dict[str, int] = defaultdict(int)
    for event in blocks:
        groups[_where(event.get("frames", []))] += event["size"]
    return sorted(groups.items(), key=lambda kv: -kv[1])


def stacks(blocks, site: str, limit: int = 3) -> list[dict]:
    """The largest distinct call stacks (innermost first) of the blocks made at ``site``."""
    groups: dict[str, int] = defaultdict(int)
    for event in blocks:
        frames = event.get("frames", [])
        if _where(frames) == site:
            groups[" <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
                               if f.get("filename", "").endswith(".py"))[:1500]] += event["size"]
    return [{"gib": b / GIB, "stack": k} for k, b in sorted(groups.items(), key=lambda kv: -kv[1])[:limit]]


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    base = int(snapshot.get("scgrpo_allocated_before", 0))
    events = snapshot["device_traces"][snapshot.get("scgrpo_device", 0)]
    marks = [i for i, e in enumerate(events) if _is_mark(e)]
    if not marks:
        raise SystemExit("no step marks in the trace: record it with scripts/bench_step.py --memory-snapshot")
    top, top_total = -1, -1
    for i, _, total, _ in replay(events, base):
        if i > marks[-1] and total > top_total:
            top, top_total = i, total
    starts, peak = {}, None
    for i, event, total, live in replay(events, base):  # again, to list what is alive at those points
        if i in (marks[0], marks[-1]):  # (the mark itself left out)
            starts[i] = (total - event["size"], by_site(e for a, e in live.items() if a != event["addr"]))
            if i == marks[-1]:
                alive = [e for a, e in live.items() if a != event["addr"]]
        if i == top:
            peak = (i, total, by_site(live.values()))
            break
    report = {"before_trace_gib": base / GIB, "steps": len(marks)}

    def table(title: str, total: int, rows: list[tuple[str, int]]) -> list[dict]:
        print(f"\n== {title}: {total / GIB:.3f} GiB ({base / GIB:.3f} GiB before the trace)")
        for where, size in rows[: args.top]:
            print(f"  {size / GIB:8.3f} GiB  {where}")
        return [{"where": w, "gib": b / GIB} for w, b in rows]

    first_total, first_rows = starts[marks[0]]
    last_total, last_rows = starts[marks[-1]]
    report["last_step_start"] = {"total_gib": last_total / GIB, "sites": table("alive at the last step's start",
                                                                              last_total, last_rows)}
    report["last_step_peak"] = {"total_gib": peak[1] / GIB, "sites": table("the last step's peak", peak[1], peak[2])}
    first = dict(first_rows)
    growth = sorted(((w, b - first.get(w, 0)) for w, b in last_rows if b > first.get(w, 0)), key=lambda kv: -kv[1])
    report["growth"] = table(f"grown from the first step's start to the last's ({len(marks) - 1} steps)",
                             last_total - first_total, growth)
    for where, _ in growth[:2]:  # where the biggest growth comes from, call stack by call stack
        report.setdefault("growth_stacks", {})[where] = found = stacks(alive, where)
        for entry in found:
            print(f"    {entry['gib']:.3f} GiB from {entry['stack'][:600]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
