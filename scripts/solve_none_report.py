"""The solve-none collapse on countdown and the options against it: docs/solve_none.md and
benchmarks/results/solve_none/summary.json, from ``scripts/replicate.py``'s result files.

    python scripts/solve_none_report.py

Countdown is a task the embedded model cannot solve, so every group is solve-none and SC-GRPO's diversity
advantage is its only signal. Read: the paper's SC-GRPO runs of the first round
(``benchmarks/results/replication/countdown_scgrpo_*.json``) and the runs of ``replicate.py --plan extra`` for
the options (``benchmarks/results/solve_none/countdown_<method>_*.json``). The page is a function of those files:
running this again gives the same bytes.
"""

from __future__ import annotations

import glob
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_ROUND = os.path.join(ROOT, "benchmarks", "results", "replication")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "solve_none")
DOC = os.path.join(ROOT, "docs", "solve_none.md")

METHODS = {
    "scgrpo": ("the paper's settings", "configs/replication/scgrpo.yaml"),
    "scgrpo-group-window": ("diversity window shared by the group", "configs/ablations/diversity_group_window.yaml"),
    "scgrpo-min16": ("no diversity score for a window under 16 tokens", "configs/ablations/diversity_min_tokens_16.yaml"),
    "scgrpo-kl-anchor": ("+ k3 KL to the base model, beta 0.04", "configs/ablations/kl_anchor.yaml"),
}
AT_STEPS = (0, 10, 25, 50, 100, 199)
COLLAPSED = 2.0  # mean completion length (tokens) under which a step counts as collapsed
HELD_LENGTH = 0.25  # held: median length over the last 100 steps at least this share of step 0's,
HELD_ENTROPY = 1.5  # median entropy over them within this factor of step 0's, and no collapsed step


def load(method: str) -> list[dict]:
    folder = FIRST_ROUND if method == "scgrpo" else RESULTS
    paths = sorted(glob.glob(os.path.join(folder, f"countdown_{method}_lr*_seed*.json")))
    return [json.load(open(p)) for p in paths]


def run_summary(run: dict) -> dict:
    steps = run["steps"]
    length = [x for x in steps["completion_length"] if x is not None]
    entropy = [x for x in steps["entropy"] if x is not None]
    collapsed = next((i for i, x in enumerate(length) if x < COLLAPSED), None)
    last = run["evaluations"][-1]
    tail_length, tail_entropy = statistics.median(length[-100:]), statistics.median(entropy[-100:])
    held = (collapsed is None and tail_length >= HELD_LENGTH * length[0]
            and entropy[0] / HELD_ENTROPY <= tail_entropy <= entropy[0] * HELD_ENTROPY)
    return {
        "seed": run["seed"], "card": run["card"], "wall_s": run["wall_s"],
        "length_at": {str(s): round(length[s], 1) for s in AT_STEPS if s < len(length)},
        "first_collapsed_step": collapsed,
        "collapsed_steps": sum(x < COLLAPSED for x in length),
        "median_length_last_100": round(statistics.median(length[-100:]), 1),
        "entropy_first": round(entropy[0], 2), "entropy_max": round(max(entropy), 2),
        "entropy_median_last_100": round(statistics.median(entropy[-100:]), 2),
        "correct_steps": sum(1 for a in steps["accuracy"] if a),
        "held": held,
        "final_id_avg8": last["id"]["avg@8"], "final_id_length": round(last["id"]["completion_length"], 1),
    }


def main(doc: str = DOC, summary_path: str = os.path.join(RESULTS, "summary.json")) -> None:
    summary = {}
    for method in METHODS:
        runs = load(method)
        if runs:
            summary[method] = {"layer": METHODS[method][1], "fit": runs[0]["fit"],
                               "commands": sorted({c for r in runs for c in r.get("commands", [r.get("command")]) if c}),
                               "runs": [run_summary(r) for r in runs]}
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    lines = [
        "# The solve-none collapse on countdown",
        "",
        "Countdown (`configs/replication/countdown.yaml`: 3 numbers to a target, 96 tokens, G = 8, 16 prompts a step, "
        "200 steps, learning rate 2e-4) is a task the embedded SmolLM2-135M-Instruct cannot solve: no run below had a "
        "correct rollout. Every group is solve-none, and SC-GRPO's diversity advantage (alpha times the standardised "
        "mean f(D) over the first min(|o_i|, |o_r|) tokens) is its only signal. One run per seed and method; "
        "lengths are the mean sampled completion length (tokens) at a step; a step counts as collapsed under "
        f"{COLLAPSED:g} tokens. The rows of the paper's settings are the first round's runs (`scripts/replicate.py "
        "--plan main`; seed 2 on an H100), not rerun beside the options, so step 0 differs a little between them.",
        "",
        "| method | layer | seed | length at steps " + ", ".join(str(s) for s in AT_STEPS)
        + " | first collapsed step | collapsed steps | median length, last 100 | entropy first / max / median last 100 "
        "| held | card |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, block in summary.items():
        for r in block["runs"]:
            at = " / ".join(str(r["length_at"].get(str(s), "-")) for s in AT_STEPS)
            lines.append(f"| {METHODS[method][0]} | `{block['layer']}` | {r['seed']} | {at} | "
                         f"{r['first_collapsed_step'] if r['first_collapsed_step'] is not None else '-'} | "
                         f"{r['collapsed_steps']} | {r['median_length_last_100']} | {r['entropy_first']} / "
                         f"{r['entropy_max']} / {r['entropy_median_last_100']} | {'yes' if r['held'] else 'no'} | {r['card']} |")
    verdicts = []
    for method, block in summary.items():
        held = sum(1 for r in block["runs"] if r["held"])
        collapsed = sum(1 for r in block["runs"] if r["first_collapsed_step"] is not None)
        verdicts.append(f"- {METHODS[method][0]}: held in {held} of {len(block['runs'])} seeds; collapsed in "
                        f"{collapsed}.")
    lines += ["", f"Held (our criterion, set after the runs): no collapsed step, the median length over the last 100 steps at least {HELD_LENGTH:g} of "
              f"step 0's, and the median entropy over them within a factor {HELD_ENTROPY:g} of step 0's "
              "(neither one-token answers nor a drift to noise or to repetition).", "", *verdicts, "",
              "Commands (each run: `scgrpo fit --config configs/replication/countdown.yaml --config <layer> "
              "--seed_everything=<seed> --data.seed=<seed>`):", ""]
    lines += [f"- {METHODS[m][0]}: `{c}`" for m, b in summary.items() for c in b["commands"]]
    lines += ["- this page: `python scripts/solve_none_report.py`", ""]
    with open(doc, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
