"""Render benchmarks/results/*.json (written by bench_quickstart.py) as the markdown tables of docs/results.md."""

from __future__ import annotations

import glob
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(pattern: str) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", pattern)))]


def evals(result: dict, split: str) -> tuple[dict, dict]:
    rows = [e for e in result["evaluations"] if f"val/{split}/avg@4" in e]
    return rows[0], rows[-1]


def fmt(x) -> str:
    return f"{x:.3f}"


def signal_table() -> str:
    runs = load("signal_*.json")
    if not runs:
        return ""
    lines = ["| objective | seed | ID Avg@4 before -> after | ID greedy after | OOD Avg@4 before -> after | OOD greedy after "
             "| s/step (mean) | train s/step (mean) |", "|---|---|---|---|---|---|---|---|"]
    by_objective: dict[str, list[dict]] = {}
    for r in runs:
        _, objective, seed = r["name"].split("_")
        by_objective.setdefault(objective, []).append(r)
        (id0, id1), (ood0, ood1) = evals(r, "id"), evals(r, "ood")
        lines.append(
            f"| {objective} | {seed.removeprefix('seed')} | {fmt(id0['val/id/avg@4'])} -> {fmt(id1['val/id/avg@4'])} "
            f"| {fmt(id1['val/id/greedy'])} | {fmt(ood0['val/ood/avg@4'])} -> {fmt(ood1['val/ood/avg@4'])} "
            f"| {fmt(ood1['val/ood/greedy'])} | {r['seconds_per_step']['mean']:.2f} | {r['train_s']['mean']:.2f} |"
        )
    lines.append("")
    lines.append("| objective | mean ID Avg@4 after | mean OOD Avg@4 after | mean s/step |")
    lines.append("|---|---|---|---|")
    for objective, rs in sorted(by_objective.items()):
        lines.append(
            f"| {objective} | {fmt(statistics.mean(evals(r, 'id')[1]['val/id/avg@4'] for r in rs))} "
            f"| {fmt(statistics.mean(evals(r, 'ood')[1]['val/ood/avg@4'] for r in rs))} "
            f"| {statistics.mean(r['seconds_per_step']['mean'] for r in rs):.2f} |"
        )
    if "scgrpo" in by_objective and "grpo" in by_objective:
        ratio = statistics.mean(r["seconds_per_step"]["mean"] for r in by_objective["scgrpo"]) / statistics.mean(
            r["seconds_per_step"]["mean"] for r in by_objective["grpo"])
        train_ratio = statistics.mean(r["train_s"]["mean"] for r in by_objective["scgrpo"]) / statistics.mean(
            r["train_s"]["mean"] for r in by_objective["grpo"])
        lines.append("")
        lines.append(f"SC-GRPO step time over GRPO's (same runs, same machine): {ratio:.2f}x for the whole step, "
                     f"{train_ratio:.2f}x for the training phase (teacher pass and loss).")
    return "\n".join(lines)


if __name__ == "__main__":
    print(signal_table())
