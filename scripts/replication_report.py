"""docs/replication.md, its figures and benchmarks/results/replication/summary.json, from the result files of
``scripts/replicate.py`` (``benchmarks/results/replication/<run>.json``, and ``calls.json``: the device calls).

    python scripts/replication_report.py                 # writes the page, the figures and the summary
    python scripts/replication_report.py --no-figures    # the page and the summary only

The page is a function of the result files alone: running this again gives the same bytes. The second round
(``ROUND2_TASKS`` x ``ROUND2_METHODS``) gets its own section, figures and ``by_task`` summary once any of its
result files exist.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replicate import ABLATIONS, MAIN, config_lr  # noqa: E402  (the method lists and rates the runs were made with)
from weight_shares import RULE_CHANGES, RULE_VERSION, Tally  # noqa: E402  (the decision-token rules)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "replication")
DOC = os.path.join(ROOT, "docs", "replication.md")
FIGURES = os.path.join(ROOT, "docs", "replication")
CONFIGS = os.path.join(ROOT, "configs", "replication")
CALIBRATION = os.path.join(ROOT, "benchmarks", "results", "reasoning", "calibration.json")

LABELS = {
    "grpo": "GRPO (clip 0.2, per-sequence mean, no KL)",
    "dapo": "DAPO (clip 0.2/0.28, dynamic sampling, token mean, overlong shaping)",
    "scgrpo": "SC-GRPO (the paper's defaults)",
    "scgrpo-buffer": "SC-GRPO with buffer references",
    "selfdistill-fkl": "GRPO + 0.1 x forward KL to the self-teacher (additive)",
    "opsd-oracle": "OPSD-oracle (JSD to a teacher shown the answer, no RL term)",
    "scgrpo-route-partial-only": "A1: partial-solve groups only (no solve-none diversity advantage)",
    "scgrpo-route-single": "A1: + single-correct groups weighted",
    "scgrpo-route-all": "A1: + single- and all-correct groups weighted",
    "scgrpo-c-p50": "A2: c = max(P50, c_min)",
    "scgrpo-c-p90": "A2: c = max(P90, c_min)",
    "scgrpo-c-fixed": "A2: c fixed at 0.05",
    "scgrpo-alpha-0.2": "A3: alpha = 0.2",
    "reinforce-pp": "REINFORCE++ (k1 KL 0.01 in the reward, batch-whitened advantages)",
    "scgrpo-kl-anchor": "SC-GRPO + KL anchor (beta 0.04, k3 to the base model; ours)",
}
REPRODUCE = ("python scripts/replicate.py --plan lr,main,ablations --per-gpu 6 && python scripts/replicate.py "
             "--plan main --tasks countdown --methods grpo,dapo,scgrpo && python scripts/replication_report.py")
METRICS = [("id", "avg@8"), ("id", "pass@8"), ("ood", "avg@8"), ("ood", "pass@8")]
SUMMARY_KEYS = {("id", "avg@8"): "id_avg8", ("id", "pass@8"): "id_pass8", ("ood", "avg@8"): "ood_avg8",
                ("ood", "pass@8"): "ood_pass8"}
# the paper's Table 1 (Qwen3-8B, Avg@8 in %), as DESIGN §2 item 7 restates it
PAPER_TABLE1 = {"AIME24": {"grpo": 41.67, "dapo": 43.75, "scgrpo": 51.67},
                "AIME25": {"grpo": 34.16, "dapo": 37.91, "scgrpo": 42.08}}
FIRST_ROUND_TASKS = ("arith", "countdown")


# --------------------------------------------------------------------------------------------------- data
def load(results_dir: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and "steps" in data and "evaluations" in data:
            runs.append(data)
    return runs


def arith_draws() -> tuple[int, int, int, int]:
    """(steps, prompts per step, prompts drawn, training problems) of the arithmetic config: the training split is
    every operand pair of the trained length under each operation, less the ID split."""
    import yaml

    with open(os.path.join(ROOT, "configs", "replication", "arith.yaml")) as f:
        config = yaml.safe_load(f)
    task = config["data"]["source"]["init_args"]
    d = task["digits"]
    pairs = (10**d - 10 ** (d - 1)) ** 2 * len(task["operations"])
    steps, batch = config["trainer"]["max_steps"], config["data"]["batch_size"]
    return steps, batch, steps * batch, pairs - task["num_eval"]


def final(run: dict) -> dict:
    return run["evaluations"][-1]


def value(run: dict, split: str, metric: str) -> Optional[float]:
    return final(run).get(split, {}).get(metric)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def signed(x: float) -> str:
    return f"{x:+.3f}"


def ms(values: list[Optional[float]], digits: int = 3) -> str:
    """Mean ± sample std of the known values ("-" without any)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def median_of(run: dict, key: str) -> Optional[float]:
    values = [v for v in run["steps"].get(key, []) if v is not None]
    return statistics.median(values) if values else None


def by_method(runs: list[dict], task: str, lr: float) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in sorted(runs, key=lambda r: (r["method"], r["seed"])):  # (--plan extra's methods are not this page's)
        if run["task"] == task and run["lr"] == lr and run["method"] in MAIN + ABLATIONS:
            out.setdefault(run["method"], []).append(run)
    return out


def paired(a: list[dict], b: list[dict], split: str, metric: str) -> list[tuple[int, float]]:
    """(seed, a - b) of a final evaluation's metric for the seeds both have."""
    return paired_by(a, b, lambda r: value(r, split, metric))


def paired_by(a: list[dict], b: list[dict], measure) -> list[tuple[int, float]]:
    """(seed, measure(a) - measure(b)) for the seeds both have where both are known."""
    seeds_b = {r["seed"]: r for r in b}
    pairs = [(r["seed"], measure(r), measure(seeds_b[r["seed"]])) for r in a if r["seed"] in seeds_b]
    return [(seed, x - y) for seed, x, y in pairs if x is not None and y is not None]


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Two-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1)."""


def interval(diffs: list[float]) -> tuple[float, float]:
    """The 95% t-interval of the mean of paired differences (needs 2 or more)."""
    m, s = mean_std(diffs)
    half = T95.get(len(diffs) - 1, 1.96) * s / math.sqrt(len(diffs))
    return m - half, m + half


def verdict(diffs: list[float]) -> str:
    """Whether a paired mean difference is told apart from zero: the 95% t-interval over seeds excludes 0."""
    if len(diffs) < 2:
        return "one seed: no verdict"
    lo, hi = interval(diffs)
    if lo <= 0 <= hi:
        return "within seed noise"
    return "higher" if lo > 0 else "lower"


# ------------------------------------------------------------------------------------------------ figures
def _series(runs: list[dict], key: str, smooth: int = 1) -> tuple[list[int], list[float], list[float], list[float]]:
    """The step numbers all runs have, and the mean / min / max over runs of a per-step key there (each run's
    series first smoothed by a trailing moving average of ``smooth`` steps)."""
    columns = []
    for run in runs:
        values = [v if v is not None else float("nan") for v in run["steps"][key]]
        if smooth > 1:
            values = [statistics.fmean([x for x in values[max(0, i - smooth + 1): i + 1] if x == x] or [float("nan")])
                      for i in range(len(values))]
        columns.append(dict(zip(run["steps"]["step"], values)))
    steps = sorted(set.intersection(*(set(c) for c in columns)))
    rows = [[c[t] for c in columns] for t in steps]
    return steps, [statistics.fmean(r) for r in rows], [min(r) for r in rows], [max(r) for r in rows]


def figures(groups: dict[str, list[dict]], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    written = []

    def figure(name: str, title: str, ylabel: str, draw, log: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        draw(ax)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("optimiser step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        written.append(path)

    def style(method: str) -> str:
        return "--" if method == "scgrpo-buffer" else "-"  # it coincides with scgrpo on most seeds

    def avg8(split: str):
        def draw(ax):
            for method in MAIN:
                runs = groups.get(method)
                if not runs:
                    continue
                per_seed = [{e["step"]: e[split]["avg@8"] for e in r["evaluations"]} for r in runs]
                steps = sorted(set.intersection(*(set(p) for p in per_seed)))  # by step number, those all have
                ax.plot(steps, [statistics.fmean(p[t] for p in per_seed) for t in steps], marker="o", ms=3,
                        label=method, ls=style(method))
                ax.fill_between(steps, [min(p[t] for p in per_seed) for t in steps],
                                [max(p[t] for p in per_seed) for t in steps], alpha=0.15)
        return draw

    def series(runs: list[dict], keys: list[tuple[str, str, str]], band: bool = True):
        def draw(ax):
            for key, label, ls in keys:
                steps, mean, lo, hi = _series(runs, key, smooth=10)
                ax.plot(steps, mean, label=label, ls=ls)
                if band:
                    ax.fill_between(steps, lo, hi, alpha=0.12)
        return draw

    for split in ("id", "ood"):
        figure(f"avg8_{split}.png", f"{split.upper()} Avg@8 (mean over seeds; band: min to max)",
               f"{split.upper()} Avg@8", avg8(split))

    def entropy(ax):
        for method in MAIN:
            if groups.get(method):
                series(groups[method], [("entropy", method, style(method))])(ax)

    figure("entropy.png", "Policy entropy (10-step moving average; band: min to max over seeds)",
           "mean token entropy of the rollouts (nats)", entropy, log=True)
    sc = groups.get("scgrpo")
    if sc:
        def kl(ax):
            series(sc, [(f"kl_p{q}", f"P{q}", "-") for q in (25, 50, 75, 95)])(ax)
            ax.axhspan(0.03, 0.10, color="grey", alpha=0.15, label="the paper's P75 range (0.03-0.10)")

        figure("kl_percentiles.png", "SC-GRPO: percentiles of the active tokens' KL (10-step moving average)",
               "per-token KL(self-teacher || policy)", kl, log=True)
        figure("routes.png", "SC-GRPO: share of groups by route (mean over seeds, 10-step average)",
               "share of groups", series(sc, [(f"route_{r}", r, "-") for r in ("partial", "solve_none", "single", "all")],
                                         band=False))
    return written


# --------------------------------------------------------------------------------------------------- page
def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def summary_block(runs: list[dict]) -> dict:
    """Mean, std and per-seed values of each metric (a metric of a split the task lacks is left out)."""
    block = {}
    for split, metric in METRICS:
        values = [value(r, split, metric) for r in runs]
        if None in values:
            continue
        m, s = mean_std(values)
        block[SUMMARY_KEYS[(split, metric)]] = {"mean": round(m, 4), "std": round(s, 4),
                                                "seeds": [round(v, 4) for v in values]}
    return block


def paired_rows(a: list[dict], b: list[dict], name: str) -> list[list[str]]:
    """Table rows of the paired differences a - b on each metric: per seed, mean, 95% interval, verdict."""
    rows = []
    for s, m in METRICS:
        diffs = paired(a, b, s, m)
        d = [x for _, x in diffs]
        if not d:
            continue
        ci = "[{:+.3f}, {:+.3f}]".format(*interval(d)) if len(d) > 1 else "-"
        rows.append([name, f"{s.upper()} {m}", ", ".join(f"{signed(x)} (seed {seed})" for seed, x in diffs),
                     signed(statistics.fmean(d)), ci, verdict(d)])
    return rows


def report(results_dir: str) -> tuple[str, dict, dict[str, list[dict]]]:
    everything = load(results_dir)
    if not everything:
        raise SystemExit(f"no result files in {results_dir}; run scripts/replicate.py first")
    runs = [r for r in everything if r["task"] in FIRST_ROUND_TASKS]
    calls_path = os.path.join(results_dir, "calls.json")
    calls = json.load(open(calls_path)) if os.path.exists(calls_path) else None
    lr = config_lr("arith")
    groups = by_method(runs, "arith", lr)
    sample = groups["scgrpo"][0]
    max_steps = max(e["step"] for r in runs for e in r["evaluations"])
    short = sorted((r for r in runs if final(r)["step"] != max_steps), key=lambda r: r["name"])
    out: list[str] = []
    w = out.append

    w("# The paper's experiment at 135M: SC-GRPO against GRPO, DAPO and the distillation baselines")
    w("")
    w("This page is written by `python scripts/replication_report.py` from the result files in "
      "`benchmarks/results/replication/` (one per run, written by `scripts/replicate.py`); running it again gives "
      "the same page. The figures are in `docs/replication/`.")
    w("")
    w("## Setup")
    w("")
    w(f"- Model: SmolLM2-135M-Instruct (the embedded GGUF, dequantised), LoRA r=16 / alpha 32 on all linear layers, "
      f"bf16, AdamW lr {lr:g} for every method.")
    w("- Task (`configs/replication/arith.yaml`): train and ID on two-digit addition and subtraction; OOD on "
      "three-digit addition and subtraction (unseen lengths), alternating with two-digit multiplication (an unseen "
      "operation). Reward 1 for the exact number, else 0.")
    w("- Budget per run, the same for every method: G = 8, 16 prompts per step, 200 steps, completions of at most "
      "64 tokens at temperature 1. DAPO's dynamic sampling draws more (see the rollouts column).")
    w("- Evaluation every 25 steps and before the first: Avg@8 and Pass@8 (8 samples at temperature 1) and greedy "
      "accuracy on 256 ID and 256 OOD problems.")
    w("- Methods: `configs/replication/{grpo,dapo,scgrpo}.yaml` and `configs/ablations/*.yaml` layered over the "
      "task config (`scripts/replicate.py` lists which file each method is).")
    seeds = sorted({r["seed"] for r in groups["scgrpo"]})
    w(f"- Seeds {', '.join(map(str, seeds))} (`--seed_everything` and `--data.seed`: the LoRA initialisation, the "
      "order of training prompts and the sampling).")
    cards: dict[str, int] = {}
    for r in runs:
        cards[r["card"]] = cards.get(r["card"], 0) + 1
    w(f"- Cards: " + ", ".join(f"{card} ({n} runs)" for card, n in sorted(cards.items()))
      + f"; the arithmetic runs on {sample['card']}, {sample['runs_per_gpu']} at a time on each of {sample['gpus']}. "
      + ", ".join(f"{k} {v}" for k, v in sample["versions"].items()) + ".")
    if calls:
        w(f"- Device: {calls['machine']}, {calls['date']}. Device time used: {calls['device_time_s'] / 60:.1f} min "
          f"({calls['note']}); wall time of the commands: "
          f"{sum(c['wall_s'] for c in calls['calls']) / 60:.1f} min. The commands:")
        w("")
        for call in calls["calls"]:
            w(f"  - {call['purpose']} ({call['wall_s']:.0f} s): `{call['command']}`")
    w("")
    w(f"To reproduce on a machine with GPUs: `{REPRODUCE}`. Each `replicate.py` command can be cut into commands of at "
      "most `--deadline-s` seconds, repeated until every run is done: finished runs are skipped and unfinished ones "
      "resume from their checkpoints.")
    w("")

    # main table
    w("## Main table (arithmetic, last evaluation)")
    w("")
    rows = []
    for method in MAIN:
        rs = groups.get(method, [])
        if not rs:
            continue
        rollouts = statistics.fmean(r["rollouts"] for r in rs)
        rows.append([method, str(len(rs)), *[ms([value(r, s, m) for r in rs]) for s, m in METRICS],
                     ms([value(r, "id", "greedy") for r in rs]), ms([value(r, "ood", "greedy") for r in rs]),
                     f"{rollouts:,.0f}"])
    out += table(["method", "seeds", "ID Avg@8", "ID Pass@8", "OOD Avg@8", "OOD Pass@8", "ID greedy", "OOD greedy",
                  "rollouts drawn"], rows)
    w("")
    w("Mean ± standard deviation over seeds (sample std). Rollouts drawn: per run over its 200 steps (the budget "
      "is 200 x 16 x 8 = 25,600; DAPO samples until 16 groups with mixed rewards are found, up to 3 extra rounds "
      "a step). Before training the base model scores "
      f"ID Avg@8 {sample['evaluations'][0]['id']['avg@8']:.3f}, OOD {sample['evaluations'][0]['ood']['avg@8']:.3f} "
      f"(greedy {sample['evaluations'][0]['id']['greedy']:.3f} / {sample['evaluations'][0]['ood']['greedy']:.3f}).")
    w("")
    w("Per seed:")
    w("")
    rows = []
    for method in MAIN:
        for r in groups.get(method, []):
            mark = " *" if final(r)["step"] != max_steps else ""
            rows.append([method, str(r["seed"]), f"{final(r)['step']}{mark}",
                         *[fmt(value(r, s, m)) for s, m in METRICS], fmt(value(r, "id", "greedy")),
                         fmt(value(r, "ood", "greedy")), f"{r['rollouts']:,}"])
    out += table(["method", "seed", "step", "ID Avg@8", "ID Pass@8", "OOD Avg@8", "OOD Pass@8", "ID greedy",
                  "OOD greedy", "rollouts"], rows)
    w("")
    if short:
        w(f"\\* The last evaluation of these runs is not after step {max_steps}: "
          + ", ".join(f"`{r['name']}` (step {final(r)['step']}; " + ("paused and resumed" if r["segments"] > 1 else
                                                                    "one segment") + ")" for r in short)
          + ". Runs paused at the end of one device command and resumed in the next lost or moved their final "
          "evaluation through a fault of the resume (since fixed); their last evaluation is used as is.")
        w("")

    # paired differences
    w("### Paired differences (same seed)")
    w("")
    rows = []
    for other in ("grpo", "dapo"):
        if groups.get(other):
            rows += paired_rows(groups["scgrpo"], groups[other], f"SC-GRPO − {other.upper()}")
    out += table(["difference", "metric", "per seed", "mean", "95% interval", "verdict"], rows)
    w("")
    w("95% interval: Student's t-interval of the mean paired difference over seeds. Verdict: \"higher\" or "
      "\"lower\" when it excludes zero, else \"within seed noise\".")
    w("")
    w("### The paper's numbers, for scale (theirs, not ours)")
    w("")
    rows = [[bench, *[f"{PAPER_TABLE1[bench][m]:.2f}" for m in ("grpo", "dapo", "scgrpo")],
             f"{PAPER_TABLE1[bench]['scgrpo'] - PAPER_TABLE1[bench]['grpo']:+.2f}",
             f"{PAPER_TABLE1[bench]['scgrpo'] - PAPER_TABLE1[bench]['dapo']:+.2f}"] for bench in PAPER_TABLE1]
    ours = {m: 100 * mean_std([value(r, "id", "avg@8") for r in groups[m]])[0] for m in ("grpo", "dapo", "scgrpo")
            if groups.get(m)}
    if len(ours) == 3:
        rows.append(["ours: arithmetic ID (SmolLM2-135M)", *[f"{ours[m]:.2f}" for m in ("grpo", "dapo", "scgrpo")],
                     f"{ours['scgrpo'] - ours['grpo']:+.2f}", f"{ours['scgrpo'] - ours['dapo']:+.2f}"])
    out += table(["Avg@8 (%)", "GRPO", "DAPO", "SC-GRPO", "SC-GRPO − GRPO", "SC-GRPO − DAPO"], rows)
    w("")
    w("The paper's rows: Table 1, Qwen3-8B with thinking off, trained on DAPO-Math-17k with responses up to 12,288 "
      "tokens, evaluated on AIME 2024 and 2025. Over its five benchmarks the paper reports +8.1% Avg@8 over GRPO, "
      "+5.86% Avg@8 and +8.92% Pass@8 over DAPO, and out of domain (LiveCodeBench -> Codeforces) +5.2% relative "
      "Avg@8 over DAPO.")
    w("")

    # ablations
    w("## Ablations (the paper's Table 3)")
    w("")
    rows = []
    base = groups.get("scgrpo", [])
    for method in ["scgrpo", *ABLATIONS]:
        rs = groups.get(method, [])
        if not rs:
            continue
        diff = [x for _, x in paired(rs, base, "id", "avg@8")] if method != "scgrpo" else []
        diff_ood = [x for _, x in paired(rs, base, "ood", "avg@8")] if method != "scgrpo" else []
        rows.append([LABELS[method], str(len(rs)), ms([value(r, "id", "avg@8") for r in rs]),
                     ms([value(r, "ood", "avg@8") for r in rs]), ms([value(r, "ood", "pass@8") for r in rs]),
                     signed(statistics.fmean(diff)) if diff else "", signed(statistics.fmean(diff_ood)) if diff_ood else "",
                     fmt(statistics.fmean(e for e in (median_of(r, "entropy") for r in rs) if e is not None))])
    out += table(["variant", "seeds", "ID Avg@8", "OOD Avg@8", "OOD Pass@8", "ΔID vs SC-GRPO", "ΔOOD vs SC-GRPO",
                  "median entropy"], rows)
    w("")
    w("Δ: mean over seeds of the paired difference to SC-GRPO with the paper's defaults. Median entropy: the "
      "median over steps of the rollouts' mean token entropy, averaged over seeds (the paper reports entropy "
      "collapse when single-correct groups are weighted).")
    w("")

    # learning rate
    sweep = {}
    for r in runs:
        if r["task"] == "arith" and r["method"] == "grpo":
            sweep.setdefault(r["lr"], []).append(r)
    if len(sweep) > 1:
        w("## Learning rate")
        w("")
        w(f"Every method ran at lr {lr:g}, the rate `configs/grpo_arith_gpu.yaml` had used for GRPO on this model "
          "before this experiment; it was fixed before these runs, for GRPO, and not tuned for any method. GRPO "
          "at two other rates, the same seeds, as a check:")
        w("")
        rows = [[f"{rate:g}", str(len(rs)), *[ms([value(r, s, m) for r in rs]) for s, m in METRICS]]
                for rate, rs in sorted(sweep.items())]
        out += table(["GRPO lr", "seeds", "ID Avg@8", "ID Pass@8", "OOD Avg@8", "OOD Pass@8"], rows)
        w("")

    # countdown
    countdown = by_method(runs, "countdown", lr)
    if countdown:
        w("## Countdown")
        w("")
        cards = {}
        for rs in countdown.values():
            for r in rs:
                cards.setdefault(r["card"], set()).add(r["seed"])
        w("`configs/replication/countdown.yaml`: reach a target with 3 given numbers (ID) or 4 (OOD) and + - * /, "
          "the same budget, completions of at most 96 tokens. Ran on "
          + "; ".join(f"{card} (seeds {', '.join(map(str, sorted(seeds)))})" for card, seeds in sorted(cards.items()))
          + ".")
        w("")
        rows = []
        for method, rs in countdown.items():
            rows.append([method, str(len(rs)), *[ms([value(r, s, m) for r in rs]) for s, m in METRICS],
                         fmt(max(v for r in rs for v in r["steps"]["reward"] if v is not None)),
                         f"{statistics.fmean(r['rollouts'] for r in rs):,.0f}"])
        out += table(["method", "seeds", "ID Avg@8", "ID Pass@8", "OOD Avg@8", "OOD Pass@8", "best step reward",
                      "rollouts drawn"], rows)
        w("")

    # figures
    w("## Figures")
    w("")
    w("![ID Avg@8](replication/avg8_id.png)")
    w("![OOD Avg@8](replication/avg8_ood.png)")
    w("![entropy](replication/entropy.png)")
    w("![KL percentiles](replication/kl_percentiles.png)")
    w("![routes](replication/routes.png)")
    w("")

    # signal statistics
    if base:
        p75 = [v for r in base for v in r["steps"]["kl_p75"] if v is not None]
        p95 = [v for r in base for v in r["steps"]["kl_p95"] if v is not None]
        shares = {k: statistics.fmean(v for r in base for v in r["steps"][f"route_{k}"] if v is not None)
                  for k in ("partial", "solve_none", "single", "all")}
        w("## The self-teacher's signal (SC-GRPO, paper defaults)")
        w("")
        inside = sum(1 for v in p75 if 0.03 <= v <= 0.10) / len(p75)
        w(f"- KL P75 over steps and seeds: median {statistics.median(p75):.3f}, "
          f"10th-90th percentile {quantile(p75, 0.1):.3f}-{quantile(p75, 0.9):.3f}; inside the paper's 0.03-0.10 on "
          f"{inside:.0%} of steps. P95 median {statistics.median(p95):.3f}, "
          f"{statistics.median(p95) / 0.5:.1f}-{statistics.median(p95) / 0.2:.1f}x the paper's 0.2-0.5.")
        w("- Share of groups by route over the run: " + ", ".join(f"{k.replace('_', '-')} {v:.2f}"
                                                                 for k, v in shares.items()) + ".")
        w("")

    # cost
    if groups.get("grpo") and base:
        w("## Cost: SC-GRPO's step over GRPO's")
        w("")
        rows = []
        for key, label in (("step_s", "whole step"), ("generation_s", "rollouts"), ("update", "update phase "
                                                                                               "(teacher + train)")):
            def med(r, key=key):
                if key == "update":  # the median over steps of teacher + train
                    st = r["steps"]
                    return statistics.median((t or 0.0) + u for t, u in zip(st["teacher_s"], st["train_s"])
                                             if u is not None)
                return median_of(r, key)
            g, s = statistics.fmean(med(r) for r in groups["grpo"]), statistics.fmean(med(r) for r in base)
            rows.append([label, f"{g:.3f}", f"{s:.3f}", f"{s / g:.2f}"])
        out += table(["phase (median s per step, mean over seeds)", "GRPO", "SC-GRPO", "SC-GRPO / GRPO"], rows)
        w("")
        solve_none = _mean(v for r in base for v in r["steps"]["route_solve_none"] if v is not None)
        share = _mean(median_of(r, "generation_s") / median_of(r, "step_s") for r in groups["grpo"])
        resumed = sum(1 for r in [*groups["grpo"], *base] if r["segments"] > 1)
        w(f"Times under contention: the runs shared GPUs ({sample['runs_per_gpu']} at a time on each), others ended "
          "or started beside them at different times"
          + (f", and {resumed} of these {len(groups['grpo']) + len(base)} runs were paused and resumed in a second "
             "command" if resumed else "")
          + ", so these ratios are rough. The paper reports +2-13% for the whole step and +37-51% for "
          "the update. Beyond its teacher pass, SC-GRPO trains on the rollouts of solve-none groups "
          f"({solve_none:.0%} of its groups here), which GRPO leaves out of the update (their advantage is zero); "
          f"and rollouts take {share:.0%} of GRPO's step here, where in the paper's they dominate.")
        w("")

    # what the numbers say
    w("## What the numbers support, and what they do not")
    w("")
    for line in conclusions(groups, countdown, sweep, lr):
        w(line)
    w("")
    missing = not_done(groups, countdown, short)
    if missing:
        w("## Not done here")
        w("")
        for line in missing:
            w(line)
        w("")
    second = round2_groups(everything)
    data = summary(groups, countdown, sample, calls, lr)
    if any(second.values()):
        out += round2(second)
        data["by_task"] = by_task({"arith": groups, "countdown": countdown, **second})
    return "\n".join(out) + "\n", data, groups


def not_done(groups: dict, countdown: dict, short: list[dict]) -> list[str]:
    lines = []
    few = [f"{m} ({len(groups.get(m, []))})" for m in [*MAIN, *ABLATIONS] if len(groups.get(m, [])) < 3]
    if few:
        lines.append(f"- Fewer than 3 seeds on arithmetic: {', '.join(few)}.")
    if countdown:
        absent = [m for m in MAIN if m not in countdown]
        few_cd = [f"{m} ({len(rs)})" for m, rs in countdown.items() if len(rs) < 3]
        lines.append("- Countdown: " + "; ".join(
            [*([f"fewer than 3 seeds: {', '.join(few_cd)}"] if few_cd else []),
             *([f"not run: {', '.join(absent)}"] if absent else []), "no ablations"]) + ".")
    else:
        lines.append("- Countdown: not run.")
    if short:
        lines.append(f"- {len(short)} run(s) without an evaluation after the last step (listed under the per-seed "
                     "table). To rerun one: delete its result file and its folder under the work directory, then run "
                     "`scripts/replicate.py` again.")
    return lines


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def first_difference(a: dict, b: dict) -> Optional[int]:
    """The first step number at which two runs' rewards differ or one of them has no row; None if none."""
    ra, rb = (dict(zip(r["steps"]["step"], r["steps"]["reward"])) for r in (a, b))
    return next((step for step in sorted(set(ra) | set(rb)) if ra.get(step, "-") != rb.get(step, "-")), None)


def _mean(values) -> float:
    return statistics.fmean(values)


def conclusions(groups: dict, countdown: dict, sweep: dict, lr: float) -> list[str]:
    """The closing paragraph: every claim in it is computed from the result files (numbers and verdicts)."""
    lines = []

    def diff(a: list[dict], b: list[dict], split: str = "id", metric: str = "avg@8") -> list[float]:
        return [x for _, x in paired(a, b, split, metric)]

    def said(d: list[float]) -> str:
        return f"{signed(_mean(d))} ({verdict(d)})"

    sc = groups["scgrpo"]
    g_id, g_ood = diff(sc, groups["grpo"]), diff(sc, groups["grpo"], "ood")
    # the paper's +8.1: the smaller of its two readings, 8.1% of GRPO's score (relative) or 0.081 (points)
    gain_id = min(0.081, 0.081 * _mean(value(r, "id", "avg@8") for r in groups["grpo"]))
    gain_ood = min(0.081, 0.081 * _mean(value(r, "ood", "avg@8") for r in groups["grpo"]))
    (lo, hi), (olo, ohi) = interval(g_id), interval(g_ood)

    def against(gain: float, lo: float, hi: float, where: str) -> str:
        if hi < gain:
            return f"a gain the size of the paper's (+{gain:.3f} here) lies above the {where} interval"
        if lo > 0:
            return f"the {where} interval lies above zero"
        return f"the {where} interval holds both zero and a gain the size of the paper's (+{gain:.3f})"

    lines.append(
        f"- **SC-GRPO against GRPO** ({len(g_id)} paired seeds): ID Avg@8 {said(g_id)}, 95% interval "
        f"[{lo:+.3f}, {hi:+.3f}]; OOD Avg@8 {said(g_ood)}, [{olo:+.3f}, {ohi:+.3f}]. Taking the paper's +8.1 as 8.1% "
        f"of GRPO's score (the smaller reading), {against(gain_id, lo, hi, 'ID')}, and "
        f"{against(gain_ood, olo, ohi, 'OOD')}.")
    if groups.get("dapo"):
        d_id, d_ood = diff(sc, groups["dapo"]), diff(sc, groups["dapo"], "ood")
        ratio = _mean(r["rollouts"] for r in groups["dapo"]) / _mean(r["rollouts"] for r in sc)
        lines.append(
            f"- **SC-GRPO against DAPO**: ID Avg@8 {said(d_id)}, OOD Avg@8 {said(d_ood)}. DAPO drew {ratio:.1f}x the "
            "rollouts of every other method (dynamic sampling refills the batch with groups of mixed rewards), so "
            "this is not an equal-sample comparison: the budget fixes steps, not rollouts.")
    per_seed = {m: {r["seed"]: median_of(r, "entropy") for r in groups[m]} for m in ("grpo", "dapo", "scgrpo")
                if groups.get(m)}
    if len(per_seed) == 3:
        above = [seed for seed, e in per_seed["scgrpo"].items() if e > per_seed["dapo"].get(seed, math.inf)]
        lines.append(
            "- **Entropy** (median over steps of the rollouts' mean token entropy, by seed): "
            + "; ".join(f"{m} " + ", ".join(f"{e:.3f}" for _, e in sorted(v.items())) for m, v in per_seed.items())
            + f". SC-GRPO's is above DAPO's in {len(above)} of {len(per_seed['scgrpo'])} seeds (the paper reports it "
            "higher than DAPO's). DAPO's is measured on the groups it keeps (those with mixed rewards) and the others' "
            "on every group, so the comparison is not like for like.")
    if groups.get("scgrpo-buffer"):
        pairs = list(zip(sc, groups["scgrpo-buffer"]))
        same = [r["seed"] for r, b in pairs if first_difference(r, b) is None]
        parted = [f"seed {r['seed']} from step {first_difference(r, b)}"
                  + (", where its runs had been paused and resumed" if r["segments"] > 1 or b["segments"] > 1 else "")
                  for r, b in pairs if r["seed"] not in same]
        lines.append(
            "- **Buffer references** cannot act at this budget: one needs an earlier verified completion of the same "
            "prompt, and "
            + "{} steps of {} prompts draw {:,} of the {:,} training problems without repeating one. ".format(*arith_draws())
            + (f"Seed(s) {', '.join(map(str, same))} trained exactly as SC-GRPO (the same reward at every step)"
               if same else "No seed trained exactly as SC-GRPO")
            + (f"; the others part: {'; '.join(parted)}" if parted else "") + ".")
    sd, op = groups.get("selfdistill-fkl"), groups.get("opsd-oracle")
    if sd:
        lines.append(
            f"- **Additive self-distillation** (GRPO + 0.1 x forward KL): against SC-GRPO ID Avg@8 {said(diff(sd, sc))}, "
            f"OOD {said(diff(sd, sc, 'ood'))}; the paper's Table 2 has every additive variant below SC-GRPO.")
    if op:
        lines.append(
            f"- **OPSD-oracle** (no RL term) ends at ID Avg@8 {ms([value(r, 'id', 'avg@8') for r in op])} against the "
            f"base model's {op[0]['evaluations'][0]['id']['avg@8']:.3f}, and ID greedy "
            f"{ms([value(r, 'id', 'greedy') for r in op])} against {op[0]['evaluations'][0]['id']['greedy']:.3f}: a "
            + ("teacher shown only the final number barely moves the model (the paper, §6.3, finds its OPSD variants "
               "close to the base model too)."
               if abs(_mean(value(r, "id", "avg@8") for r in op) - op[0]["evaluations"][0]["id"]["avg@8"]) < 0.05 else
               "teacher shown the final number moves the model this far."))
    abl = [m for m in ABLATIONS if groups.get(m)]
    if abl:
        apart = [f"{m} ({split.upper()} {said(diff(groups[m], sc, split))})" for m in abl for split in ("id", "ood")
                 if verdict(diff(groups[m], sc, split)) not in ("within seed noise", "one seed: no verdict")]
        lines.append(
            "- **Ablations**: " + ("no variant differs from the defaults beyond seed noise in ID or OOD Avg@8, so "
                                   "the paper's Table 3 ordering (routing, c, alpha) cannot be read from 3 seeds at "
                                   "this scale." if not apart else "beyond seed noise: " + "; ".join(apart) + "."))
        if groups.get("scgrpo-route-all") and all(
                verdict(diff(groups["scgrpo-route-all"], groups.get("scgrpo-route-single", sc), split))
                == "within seed noise" for split in ("id", "ood")):
            lines.append(
                "  Adding all-correct groups to single-correct ones changes nothing beyond seed noise; our reading "
                "(the share of such rows was not recorded): their rollouts are mostly the same bare number, and a "
                "rollout with no distinct correct sibling keeps weight 1.")
        if groups.get("scgrpo-route-single"):
            e_def = _mean(median_of(r, "entropy") for r in sc)
            e_single = _mean(median_of(r, "entropy") for r in groups["scgrpo-route-single"])
            lines.append(
                f"  Weighting single-correct groups: median entropy {e_single:.3f} against {e_def:.3f} with the "
                "defaults" + (", no entropy collapse here, unlike the paper's A1." if e_single >= 0.5 * e_def else
                              ", lower, as in the paper's A1 (entropy collapse)."))
    if sweep and lr in sweep:
        best = max(sweep, key=lambda rate: _mean(value(r, "id", "avg@8") for r in sweep[rate]))
        parts = [f"{rate:g}: {_mean(value(r, 'id', 'avg@8') for r in rs):.3f}" for rate, rs in sorted(sweep.items())]
        lines.append(
            "- **Learning rate** (GRPO, ID Avg@8): " + ", ".join(parts) + "."
            + (f" The rate used, {lr:g}, is the best." if best == lr else
               f" The rate used, {lr:g}, against the best ({best:g}): {said(diff(sweep[lr], sweep[best]))}."))
    if countdown:
        found = {m: sum(1 for r in rs for v in r["steps"]["reward"] if v) for m, rs in countdown.items()}
        steps = {m: sum(len(r["steps"]["reward"]) for r in rs) for m, rs in countdown.items()}
        scored = max(value(r, s, m) for rs in countdown.values() for r in rs for s, m in METRICS)
        line = ("- **Countdown**: training steps with any correct rollout: "
                + ", ".join(f"{m} {found[m]} of {steps[m]}" for m in countdown) + ". "
                + ("The base model almost never writes a correct equation at temperature 1, so nearly every group is "
                   "solve-none and GRPO's and DAPO's gradients are zero"
                   if sum(found.values()) <= 0.01 * sum(steps.values()) else "Correct rollouts do occur")
                + ("; no method scores on the evaluation." if scored == 0 else
                   f"; the best evaluation score is {scored:.3f}."))
        sc_cd = countdown.get("scgrpo", [])
        lengths = [(r["evaluations"][0]["id"]["completion_length"], r["evaluations"][-1]["id"]["completion_length"])
                   for r in sc_cd]
        if lengths and all(after < 2 for _, after in lengths):
            line += (" SC-GRPO, whose solve-none diversity advantage is then its only signal, collapsed in every seed "
                     "to answers of one token (mean ID completion length "
                     + ", ".join(f"{b:.1f} -> {a:.1f}" for b, a in lengths)
                     + "). The diversity score averages f(D) over the first min(|o_i|, |o_r|) tokens, so a short "
                     "rollout or a short reference is scored on its first tokens alone, where the two views differ "
                     "most; that this drives the collapse is our reading, not a measured cause.")
        lines.append(line)
    shares = {k: _mean(v for r in sc for v in r["steps"][f"route_{k}"] if v is not None)
              for k in ("partial", "solve_none", "single", "all")}
    lines.append(
        "- **What this does not show**: anything about the paper's setting (an 8B model, long reasoning, AIME). "
        f"Here answers are a few tokens; over SC-GRPO's runs {shares['partial']:.0%} of groups were partial-solve "
        f"(where the KL weight acts on the GRPO gradient), {shares['solve_none']:.0%} solve-none, "
        f"{shares['single']:.0%} single-correct and {shares['all']:.0%} all-correct. Three seeds resolve differences "
        "of a few points at best.")
    return lines


def summary(groups: dict, countdown: dict, sample: dict, calls: Optional[dict], lr: float) -> dict:
    return {
        "task": "arith",
        "card": sample["card"],
        "command": REPRODUCE,
        "cards": sorted({r["card"] for rs in [*groups.values(), *countdown.values()] for r in rs}),
        "device_commands": [c["command"] for c in calls["calls"]] if calls else [],
        "lr": lr,
        "methods": {m: summary_block(groups[m]) for m in MAIN if groups.get(m)},
        "ablations": {m: summary_block(groups[m]) for m in ABLATIONS if groups.get(m)},
        "countdown": {m: summary_block(rs) for m, rs in countdown.items()},
    }


# ------------------------------------------------------------------------------------------- second round
ROUND2_TASKS = ["chain_sum", "lcm", "tool_calc", "blackjack"]
"""The second round's tasks, each with its config ``configs/replication/<task>.yaml`` (the first two are
reasoning_gym tasks)."""
ROUND2_METHODS = ["grpo", "dapo", "reinforce-pp", "scgrpo", "scgrpo-kl-anchor"]
ROUND2_SEEDS = [0, 1, 2]
ROUND2_COMMAND = ("python scripts/replicate.py --plan main,extra --tasks " + ",".join(ROUND2_TASKS) + " --methods "
                  + ",".join(ROUND2_METHODS) + " && python scripts/replication_report.py")
TEACHER_METHODS = ["scgrpo", "scgrpo-kl-anchor"]
"""The second round's methods with routes, a self-teacher and token weights f."""
NAMES = {"grpo": "GRPO", "dapo": "DAPO", "reinforce-pp": "REINFORCE++", "scgrpo": "SC-GRPO",
         "scgrpo-kl-anchor": "SC-GRPO + anchor"}
ROUND2_PAIRS = [("scgrpo", "grpo"), ("scgrpo", "dapo"), ("scgrpo", "reinforce-pp"), ("scgrpo-kl-anchor", "scgrpo")]
ROUTES = ["partial", "solve_none", "single", "all"]
"""The routes of the per-step ``route_<name>`` shares ("all": all-correct groups). In ``weight_shares`` the key
"pooled" pools every route."""
SHARE_KEYS = [("decision_token_share", "decision token share"), ("decision_f_share", "decision f share"),
              ("mean_f_decision", "mean f, decision tokens"), ("mean_f_other", "mean f, the rest")]
MIN_TOKENS = 100
"""A logged step counts toward a run's concentration after the first logged step when it has at least MIN_TOKENS
teacher tokens in the route measured (the verdicts read the pooled route)."""
SATURATED = 0.99
"""A task leaves no headroom when every method's mean final ID Pass@8 is at least SATURATED."""
LAST = 20
"""A run's final completion length and entropy: the median over its last LAST steps."""


def task_config(task: str) -> Optional[dict]:
    """The task's ``configs/replication/<task>.yaml``, or None without one."""
    import yaml

    path = os.path.join(CONFIGS, f"{task}.yaml")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def round2_groups(runs: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """task -> method -> runs by seed, for every second-round task (empty where none ran), at the task config's
    learning rate (at any rate for a task without a config)."""
    out: dict[str, dict[str, list[dict]]] = {}
    for task in ROUND2_TASKS:
        config = task_config(task)
        lr = float(config["model"]["optimizer"]["init_args"]["lr"]) if config else None
        chosen = [r for r in runs if r["task"] == task and r["method"] in ROUND2_METHODS
                  and (lr is None or r["lr"] == lr)]
        out[task] = {m: sorted((r for r in chosen if r["method"] == m), key=lambda r: r["seed"])
                     for m in ROUND2_METHODS if any(r["method"] == m for r in chosen)}
    return out


def known_mean(values) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def first_step(run: dict, key: str) -> Optional[float]:
    """A per-step key at the first step that has it."""
    return next((v for v in run["steps"].get(key, []) if v is not None), None)


def last_median(run: dict, key: str) -> Optional[float]:
    """The median of a per-step key over the run's last LAST steps that logged it."""
    values = [v for v in run["steps"].get(key, []) if v is not None][-LAST:]
    return statistics.median(values) if values else None


def trained_steps(run: dict) -> int:
    """The steps that trained on a batch (logged a reward): DAPO skips a step whose groups all stay uniform after
    its extra sampling rounds."""
    return sum(v is not None for v in run["steps"]["reward"])


def shares_by_step(run: dict) -> dict[str, dict]:
    """A run's weight-shares summaries by logged step ({step: {route: summary}}; empty where absent)."""
    return (run.get("weight_shares") or {}).get("by_step", {})


def base_step(run: dict) -> Optional[str]:
    """The logged step whose rollouts the base policy drew, before any update, or None: the first logged step when
    it is step 0 or 1 (CreditLogging records the optimiser step count after the batch's update, so the first batch
    logs as step 1)."""
    steps = sorted(shares_by_step(run), key=int)
    return steps[0] if steps and int(steps[0]) <= 1 else None


def base_concentration(run: dict, route: str = "pooled") -> Optional[float]:
    """A route's concentration at the run's base-policy step, read as every step is: when the route has MIN_TOKENS
    teacher tokens or more there (None otherwise, or without the step)."""
    step = base_step(run)
    block = shares_by_step(run)[step].get(route) if step is not None else None
    return block["concentration"] if block and block["tokens"] >= MIN_TOKENS else None


def counted_steps(run: dict, route: str = "pooled") -> list[tuple[int, dict]]:
    """(step, summary) of a route at each logged step after the base-policy step that has MIN_TOKENS teacher tokens
    or more and a concentration, in step order."""
    base = base_step(run)
    blocks = [(int(step), block.get(route)) for step, block in shares_by_step(run).items() if step != base]
    return sorted((step, b) for step, b in blocks
                  if b and b["tokens"] >= MIN_TOKENS and b.get("concentration") is not None)


def pooled(blocks: list[dict]) -> dict:
    """One summary of several steps' summaries, their tokens counted together."""
    tally = Tally()
    for b in blocks:
        rest = b["tokens"] - b["decision_tokens"]
        tally.n[0] += b["decision_tokens"]
        tally.n[1] += rest
        tally.f[0] += (b["mean_f_decision"] or 0.0) * b["decision_tokens"]
        tally.f[1] += (b["mean_f_other"] or 0.0) * rest
    return tally.summary()


def trained(run: dict, route: str = "pooled") -> Optional[dict]:
    """A run's weight after the first logged step: ``concentration``, the mean over :func:`counted_steps` (each
    step weighted equally), with the number of ``steps`` and ``tokens`` behind it and the steps' tokens ``pooled``
    (:func:`pooled`); None without a counted step."""
    steps = [b for _, b in counted_steps(run, route)]
    if not steps:
        return None
    return {"concentration": statistics.fmean(b["concentration"] for b in steps), "steps": len(steps),
            "tokens": sum(b["tokens"] for b in steps), "pooled": pooled(steps)}


def step_label(runs: list[dict]) -> str:
    """How the page names the base-policy step of these runs: "step N" when they share it."""
    steps = {base_step(r) for r in runs if base_step(r) is not None}
    return f"step {steps.pop()}" if len(steps) == 1 else "the first logged step"


def earlier_rules(runs: list[dict]) -> list[tuple[str, list[int], int]]:
    """(rule, the earlier versions found, the version now) for each rule that some of the runs' shares were
    computed under in an earlier version than ``scripts/weight_shares.py`` applies now (a result file without a
    version has version 1)."""
    out = []
    for rule in sorted({r["weight_shares"]["rule"] for r in runs if r.get("weight_shares")}):
        now = RULE_VERSION.get(rule, 1)
        then = sorted({v for r in runs if r.get("weight_shares") and r["weight_shares"]["rule"] == rule
                       for v in [r["weight_shares"].get("rule_version") or 1] if v < now})
        if then:
            out.append((rule, then, now))
    return out


def earlier_rule_note(runs: list[dict]) -> Optional[str]:
    """The sentence under the weight table when :func:`earlier_rules` finds any; else None."""
    said = [f"these shares were computed under version {', '.join(map(str, then))} of the `{rule}` rule, and "
            f"`scripts/weight_shares.py` now applies version {now}"
            + (f" ({RULE_CHANGES[(rule, now)]})" if (rule, now) in RULE_CHANGES else "")
            for rule, then, now in earlier_rules(runs)]
    return ("Note: " + "; ".join(said) + ".") if said else None


def concentration_methods(groups: dict[str, list[dict]]) -> list[str]:
    """The methods of a task whose weight concentration can be drawn per logged step."""
    return [m for m in TEACHER_METHODS
            if any(base_concentration(r) is not None or counted_steps(r) for r in groups.get(m, []))]


def missing_seeds(second: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Per task, the methods with fewer than the planned seeds, and which seeds they lack."""
    lines = []
    for task, groups in second.items():
        if not groups:
            lines.append(f"{task}: not run")
            continue
        lacking = []
        for method in ROUND2_METHODS:
            have = {r["seed"] for r in groups.get(method, [])}
            absent = [s for s in ROUND2_SEEDS if s not in have]
            if absent:
                seeds = ", ".join(map(str, absent))
                lacking.append(f"{method} (seed{'s' if len(absent) > 1 else ''} {seeds} missing)")
        if lacking:
            lines.append(f"{task}: " + ", ".join(lacking))
    return lines


def _arg(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def round2_budget(task: str, config: Optional[dict]) -> str:
    """What a task's config sets: the prompt source, the budget per run and the evaluation."""
    if config is None:
        return f"**{task}**: no `configs/replication/{task}.yaml` in this checkout."
    model, data, trainer = config["model"], config["data"], config["trainer"]
    gen, episodes, k = model["generation"], model.get("episodes"), model.get("eval_samples", 8)
    source = data["source"] if isinstance(data["source"], dict) else {"class_path": str(data["source"])}
    args = source.get("init_args") or {}
    ood = args.get("num_ood", args.get("num_eval") if "ood_config" in args else None)
    return (f"**{task}** (`configs/replication/{task}.yaml`): prompts from `{source['class_path']}`"
            + (" (" + ", ".join(f"`{key}={_arg(v)}`" for key, v in args.items()) + ")" if args else "")
            + f"; {trainer['max_steps']} steps of {data['batch_size']} prompts x G = {gen['num_generations']}, at "
            f"most {gen['max_new_tokens']} new tokens a completion"
            + (f" (episodes of up to {episodes['max_turns']} model turns, {episodes['max_episode_tokens']} tokens in "
               "all)" if episodes else "")
            + f", temperature {gen['temperature']:g}, lr {float(model['optimizer']['init_args']['lr']):g}. "
            f"Evaluation: Avg@{k}, Pass@{k} and greedy accuracy on {args.get('num_eval', '?')} ID"
            + (f" and {ood} OOD" if ood is not None else "")
            + f" problems, every {trainer['val_check_interval']} steps and before the first.")


def round2_setup(task: str, groups: dict[str, list[dict]]) -> list[str]:
    """One bullet per task: its config's budget, then the cards and the commands of its result files."""
    runs = [r for rs in groups.values() for r in rs]
    places: dict[tuple[str, int, int], int] = {}
    for r in runs:
        key = (r["card"], r.get("gpus") or 0, r["runs_per_gpu"])
        places[key] = places.get(key, 0) + 1
    commands = list(dict.fromkeys(c for r in runs for c in (r.get("commands") or [r.get("command")]) if c))
    head = (f"- {round2_budget(task, task_config(task))} Ran on "
            + "; ".join((f"{gpus} GPU{'s' if gpus > 1 else ''} ({card})" if gpus else card)
                        + f", {per} at a time per GPU ({n} runs)" for (card, gpus, per), n in sorted(places.items()))
            + "." + (" Commands:" if commands else ""))
    return [head, *(f"  - `{c}`" for c in commands)]


def round2_results(groups: dict[str, list[dict]]) -> list[str]:
    """The table of final evaluations by method, and the base model's row."""
    rows = []
    for method, rs in groups.items():
        rows.append([method, str(len(rs)), *[ms([value(r, s, m) for r in rs]) for s, m in METRICS],
                     ms([value(r, "id", "greedy") for r in rs]),
                     ms([last_median(r, "completion_length") for r in rs], 1),
                     "/".join(str(trained_steps(r)) for r in rs) + f" of {len(rs[0]['steps']['step'])}",
                     f"{statistics.fmean(r['rollouts'] for r in rs):,.0f}", ms([r["wall_s"] for r in rs], 0)])
    before = [r["evaluations"][0] for rs in groups.values() for r in rs if r["evaluations"][0]["step"] == 0]
    if before:
        rows.append([f"before training ({len(before)} runs)", "-",
                     *[fmt(known_mean(e.get(s, {}).get(m) for e in before)) for s, m in METRICS],
                     fmt(known_mean(e["id"].get("greedy") for e in before)), "-", "-", "-", "-"])
    return table(["method", "seeds", "ID Avg@8", "ID Pass@8", "OOD Avg@8", "OOD Pass@8", "ID greedy",
                  "completion length", "steps trained", "rollouts drawn", "wall s"], rows)


def round2_paired(groups: dict[str, list[dict]]) -> list[str]:
    rows = []
    for a, b in ROUND2_PAIRS:
        if groups.get(a) and groups.get(b):
            rows += paired_rows(groups[a], groups[b], f"{NAMES[a]} − {NAMES[b]}")
    return table(["difference", "metric", "per seed", "mean", "95% interval", "verdict"], rows) if rows else []


def round2_signal(groups: dict[str, list[dict]]) -> list[str]:
    """Route shares, KL percentiles and mean f of the methods with a self-teacher; entropy of every method."""
    rows = []
    for method, rs in groups.items():
        teacher = method in TEACHER_METHODS
        routes = [fmt(known_mean(v for r in rs for v in r["steps"].get(f"route_{k}", [])), 2) if teacher else "-"
                  for k in ROUTES]
        credit = [fmt(known_mean(median_of(r, key) for r in rs)) if teacher else "-"
                  for key in ("kl_p50", "kl_p95", "f_mean")]
        rows.append([method, *routes, *credit, fmt(known_mean(first_step(r, "entropy") for r in rs)),
                     fmt(known_mean(last_median(r, "entropy") for r in rs))])
    return table(["method", "partial", "solve-none", "single", "all-correct", "KL P50", "KL P95", "f mean",
                  "entropy, first step", f"entropy, last {LAST} steps"], rows)


def round2_weights(groups: dict[str, list[dict]]) -> list[str]:
    """Where the weight goes: per SC-GRPO method and route, the concentration at the base-policy step and after
    it (:func:`trained`), and the shares of the steps after it; mean ± std over seeds."""
    runs = [r for m in TEACHER_METHODS for r in groups.get(m, []) if r.get("weight_shares")]
    if not runs:
        return []
    rules = sorted({(r["weight_shares"]["rule"], tuple(r["weight_shares"].get("names", []))) for r in runs})
    found = {route for r in runs for block in shares_by_step(r).values() for route in block}
    routes = ["pooled", *[k for k in ROUTES if k in found], *sorted(found - set(ROUTES) - {"pooled"})]
    label = step_label(runs)
    rows = []
    for method in TEACHER_METHODS:
        rs = [r for r in groups.get(method, []) if r.get("weight_shares")]
        for route in routes:
            base = [base_concentration(r, route) for r in rs]
            after = [trained(r, route) for r in rs]
            if all(b is None for b in base) and not any(after):
                continue
            known = [t for t in after if t]
            rows.append([method, "all-correct" if route == "all" else route, str(len(rs)), _of(base, len(rs)),
                         _of([t["concentration"] for t in known], len(rs)),
                         "/".join(str(t["steps"] if t else 0) for t in after),
                         "/".join(f"{t['tokens']:,}" if t else "0" for t in after),
                         *[ms([t["pooled"].get(key) for t in known]) for key, _ in SHARE_KEYS]])
    said = "; ".join(f"`{rule}`" + (f" on {', '.join(names)}" if names else "") for rule, names in rules)
    lines = [(f"Decision tokens: the rule {said} of `scripts/weight_shares.py`, over the rollouts each run logged "
              "(rows with a teacher only)."), ""]
    note = earlier_rule_note(runs)
    if note:
        lines += [note, ""]
    return lines + table(["method", "route", "seeds", f"concentration, {label} (base policy)",
                          f"concentration after {label}", "steps counted, per seed", "tokens counted, per seed",
                          *[name for _, name in SHARE_KEYS]], rows)


def _of(values: list[Optional[float]], seeds: int) -> str:
    """:func:`ms` of the known values, saying how many seeds have one when not all do."""
    known = [v for v in values if v is not None]
    return ms(known) + (f" ({len(known)} of {seeds} seeds)" if known and len(known) < seeds else "")


def weights_caption(groups: dict[str, list[dict]]) -> str:
    """The caption under the weight table."""
    label = step_label([r for m in TEACHER_METHODS for r in groups.get(m, []) if r.get("weight_shares")])
    return ("Concentration: the decision tokens' share of the f mass over their share of the tokens (above 1: the "
            f"weight sits on decision tokens more than uniform weights would), read at a logged step only when the "
            f"route has at least {MIN_TOKENS} teacher tokens there. The rollouts logged at {label} were drawn by the "
            "base policy, before any update, so that step is shown apart. After it, per run: the mean over the later "
            "logged steps read, each step weighted equally (steps and tokens counted, per seed; 0: none). The share "
            "and mean-f columns pool the tokens of the same steps. Then mean ± std over the seeds that have a value.")


def _said(d: list[float]) -> str:
    """A paired difference as the conclusions state it: mean, 95% interval and verdict."""
    if not d:
        return "no paired seeds"
    if len(d) < 2:
        return f"{signed(_mean(d))} (one seed: no verdict)"
    lo, hi = interval(d)
    return f"{signed(_mean(d))}, 95% interval [{lo:+.3f}, {hi:+.3f}], {verdict(d)}"


def beat(groups: dict[str, list[dict]], other: str) -> str:
    """Whether SC-GRPO beat another method beyond seed noise on ID and OOD Avg@8."""
    if not groups.get("scgrpo") or not groups.get(other):
        absent = NAMES[other] if groups.get("scgrpo") else "SC-GRPO"
        return f"SC-GRPO against {NAMES[other]}: not compared (no runs of {absent})."
    d = {s: [x for _, x in paired(groups["scgrpo"], groups[other], s, "avg@8")] for s in ("id", "ood")}
    won, lost = ([s.upper() for s in ("id", "ood") if len(d[s]) > 1 and verdict(d[s]) == side]
                 for side in ("higher", "lower"))
    head = (f"SC-GRPO beat {NAMES[other]} beyond seed noise on " + " and ".join(won) + " Avg@8" if won
            else f"SC-GRPO did not beat {NAMES[other]} beyond seed noise")
    if lost:
        head += f", and scored below it beyond seed noise on " + " and ".join(lost) + " Avg@8"
    return head + f" (ID Avg@8 {_said(d['id'])}; OOD Avg@8 {_said(d['ood'])})."


def beaten_on(groups: dict[str, list[dict]], other: str, side: str = "higher") -> Optional[bool]:
    """Whether SC-GRPO scored ``side`` ("higher": above, "lower": below) ``other`` beyond seed noise on ID or OOD
    Avg@8 (None: not both ran on 2+ seeds)."""
    if not groups.get("scgrpo") or not groups.get(other):
        return None
    d = [[x for _, x in paired(groups["scgrpo"], groups[other], s, "avg@8")] for s in ("id", "ood")]
    if any(len(x) < 2 for x in d):
        return None
    return any(verdict(x) == side for x in d)


def _seeds_said(values: list[tuple[int, dict]]) -> str:
    return ", ".join(f"{t['concentration']:.2f} (seed {s}: {t['steps']} step{'s' if t['steps'] > 1 else ''}, "
                     f"{t['tokens']:,} tokens)" for s, t in values)


def lean(values: list[float]) -> str:
    """The verdict over seeds on a method's concentration: the mean with its 95% t-interval; "concentrates on
    decision tokens" only when the interval lies above 1, "leans away from decision tokens" only when below."""
    if len(values) < 2:
        return f"one seed ({values[0]:.2f}): no interval, no verdict"
    lo, hi = interval(values)
    said = ("concentrates on decision tokens" if lo > 1 else "leans away from decision tokens" if hi < 1 else
            "no clear lean")
    return f"mean {_mean(values):.2f}, 95% interval [{lo:.2f}, {hi:.2f}]: {said}"


def no_rows(run: dict) -> str:
    """What a run without a counted step after the first (:func:`counted_steps`) logged there."""
    base = base_step(run)
    later = [b.get("pooled") or {} for step, b in shares_by_step(run).items() if step != base]
    tokens, steps = sum(b.get("tokens", 0) for b in later), sum(1 for b in later if b.get("tokens"))
    if not tokens:
        return "no teacher rows after the first step"
    return (f"no teacher rows after the first step at a logged step with {MIN_TOKENS} teacher tokens or more "
            f"({steps} step{'s' if steps > 1 else ''} with fewer, {tokens:,} tokens in all)")


def concentrates(groups: dict[str, list[dict]], method: str) -> str:
    """Where a method's weight sits, after the first logged step (:func:`trained`, pooled route): above 1 in every
    seed, below 1 in every seed, or mixed, and :func:`lean` over seeds; then the base-policy step apart."""
    runs = [r for r in groups[method] if r.get("weight_shares")]
    if not runs:
        return f"{NAMES[method]}: no weight shares recorded."
    label = step_label(runs)
    by_seed = [(r["seed"], trained(r)) for r in runs]
    have = [(seed, t) for seed, t in by_seed if t]
    lacking = [seed for seed, t in by_seed if not t]
    base = [(r["seed"], base_concentration(r)) for r in runs]
    base = [(seed, c) for seed, c in base if c is not None]
    tail = ((f" At {label} (the base policy's rollouts): " + ", ".join(f"{c:.2f} (seed {seed})" for seed, c in base)
             + ".") if base else "")
    rule = "".join(f" (under version {', '.join(map(str, then))} of the `{name}` rule, not {now})"
                   for name, then, now in earlier_rules(runs))
    if not have:
        return (f"{NAMES[method]}: no teacher rows after the first step, in any seed ("
                + "; ".join(f"seed {r['seed']}: {no_rows(r)}" for r in runs) + f").{tail}")
    values = [t["concentration"] for _, t in have]
    every = "in every seed" if len(values) > 1 else "in the one seed with a value"
    where = (f"above 1 {every}" if all(c > 1 for c in values) else f"below 1 {every}" if all(c < 1 for c in values)
             else "mixed (above 1 in some seeds, not in others)")
    return (f"{NAMES[method]}'s concentration after {label}{rule} is {where}: {_seeds_said(have)}"
            + "".join(f"; seed {r['seed']}: {no_rows(r)}" for r in runs if r["seed"] in lacking)
            + f"; {lean(values)}.{tail}")


def same_scores(groups: dict[str, list[dict]]) -> list[list[str]]:
    """Sets of two or more methods whose final ID and OOD Avg@8 are the same in every seed they both ran (two
    seeds or more)."""
    def scores(run: dict) -> tuple:
        return tuple(None if value(run, s, "avg@8") is None else round(value(run, s, "avg@8"), 9) for s in ("id", "ood"))

    def alike(a: str, b: str) -> bool:
        mine = {r["seed"]: scores(r) for r in groups[a]}
        theirs = {r["seed"]: scores(r) for r in groups[b]}
        both = sorted(set(mine) & set(theirs))
        return len(both) > 1 and all(mine[seed] == theirs[seed] for seed in both)

    sets: list[list[str]] = []
    for method in groups:
        home = next((found for found in sets if alike(found[0], method)), None)
        if home:
            home.append(method)
        else:
            sets.append([method])
    return [found for found in sets if len(found) > 1]


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def headroom(groups: dict[str, list[dict]]) -> list[str]:
    """Why a task may leave no room to tell the methods apart: "saturated" when every method's mean final ID Pass@8
    is SATURATED or more; "methods converged to the same scores" when :func:`same_scores` finds any (named)."""
    flags = []
    passes = [known_mean(value(r, "id", "pass@8") for r in rs) for rs in groups.values()]
    if passes and all(p is not None and p >= SATURATED for p in passes):
        flags.append(f"saturated, every method's mean final ID Pass@8 is {SATURATED:g} or more")
    for found in same_scores(groups):
        flags.append(f"methods converged to the same scores, {_listed([NAMES.get(m, m) for m in found])} have the "
                     "same final ID and OOD Avg@8 in every seed")
    return flags


def anchored(groups: dict[str, list[dict]]) -> str:
    """Whether the KL anchor changed anything against SC-GRPO: the four metrics and the completion length."""
    a, b = groups.get("scgrpo-kl-anchor"), groups.get("scgrpo")
    if not a or not b:
        return "The KL anchor: not compared (no runs of " + ("SC-GRPO + anchor" if not a else "SC-GRPO") + ")."
    apart = []
    for s, m in METRICS:
        d = [x for _, x in paired(a, b, s, m)]
        if len(d) > 1 and verdict(d) in ("higher", "lower"):
            apart.append(f"{s.upper()} {m} {_said(d)}")
    lengths = [x for _, x in paired_by(a, b, lambda r: last_median(r, "completion_length"))]
    length = (f"completion length {fmt(known_mean(last_median(r, 'completion_length') for r in a), 1)} against "
              f"{fmt(known_mean(last_median(r, 'completion_length') for r in b), 1)} tokens (paired "
              + (f"{_mean(lengths):+.1f}, {verdict(lengths)}" if lengths else "no paired seeds") + ")")
    return ("The KL anchor changed " + ("; ".join(apart) if apart else "none of the four metrics")
            + f" beyond seed noise; {length}.")


def round2_conclusions(second: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The closing paragraph: every claim in it is computed from the result files (numbers and verdicts)."""
    lines = []
    ran = {task: groups for task, groups in second.items() if groups}
    for other in ("grpo", "dapo"):
        compared = [t for t, groups in ran.items() if beaten_on(groups, other) is not None]
        if compared:
            said = []
            for side, where in (("higher", "above"), ("lower", "below")):
                tasks = [t for t in compared if beaten_on(ran[t], other, side)]
                said.append(f"{where} it on {len(tasks)} of {len(compared)} tasks"
                            + (f" ({', '.join(tasks)})" if tasks else ""))
            lines.append(f"- **SC-GRPO against {NAMES[other]}, over the tasks**, beyond seed noise on ID or OOD "
                         f"Avg@8: {'; '.join(said)}.")
    for task, groups in ran.items():
        flags = headroom(groups)
        parts = [beat(groups, "grpo"), beat(groups, "dapo"),
                 *[concentrates(groups, m) for m in TEACHER_METHODS if groups.get(m)], anchored(groups),
                 *lengths_said(task, groups)]
        lines.append(f"- **{task}**: " + (f"No headroom: {'; '.join(flags)}. " if flags else "") + " ".join(parts))
    missing = missing_seeds(second)
    lines.append("- **Missing runs** (fewer than " + f"{len(ROUND2_SEEDS)} seeds): "
                 + ("; ".join(missing) if missing else "none") + ".")
    return lines


def reasoning_args(task: str) -> Optional[dict]:
    """The prompt source's init_args of a task config that names a reasoning_gym task (``task``), else None."""
    source = ((task_config(task) or {}).get("data") or {}).get("source")
    init = source.get("init_args") if isinstance(source, dict) else None
    return init if isinstance(init, dict) and "task" in init else None


def setting_key(task: str, config: Optional[dict]) -> tuple[str, str]:
    """A (task, settings) pair as the calibration file and the configs are matched."""
    return task, json.dumps(config or {}, sort_keys=True)


def calibrated_length(task: str, path: str = CALIBRATION) -> Optional[float]:
    """The base model's mean correct-completion length on the task's settings (the calibration file), or None."""
    init = reasoning_args(task)
    if init is None or not os.path.exists(path):
        return None
    with open(path) as f:
        rows = json.load(f)["results"]
    key = setting_key(init["task"], init.get("config"))
    return next((r["mean_correct_length"] for r in rows if setting_key(r["task"], r["config"]) == key), None)


def lengths_said(task: str, groups: dict[str, list[dict]], path: str = CALIBRATION) -> list[str]:
    """For a calibrated task: the base model's correct completions' length against the trained methods' final
    completion lengths (whether the task still needed long answers once trained)."""
    base = calibrated_length(task, path)
    finals = {m: known_mean(last_median(r, "completion_length") for r in rs) for m, rs in groups.items()}
    finals = {m: v for m, v in finals.items() if v is not None}
    if base is None or not finals:
        return []
    short = [m for m, v in finals.items() if v < 40]
    return [f"The base model's correct completions took {base:.0f} tokens; trained, the methods' final completions "
            f"(all rollouts) took {min(finals.values()):.1f} to {max(finals.values()):.1f} tokens"
            + (f", under the 40-token floor the settings were chosen for with {', '.join(NAMES[m] for m in short)}"
               if short else "") + "." + shortcut_said(task)]


def shortcut_said(task: str) -> str:
    """For a reasoning_gym task whose problems list their numbers: how many ID problems the largest given number
    answers (a shortcut a policy can learn without working), else ""."""
    init = reasoning_args(task)
    if init is None:
        return ""
    try:
        import reasoning_gym
    except ImportError:
        return ""
    rows = reasoning_gym.create_dataset(init["task"], seed=init.get("seed", 1234) + 1, size=init.get("num_eval", 64),
                                        **(init.get("config") or {}))
    if not all(isinstance(e["metadata"].get("numbers"), list) for e in rows):
        return ""
    hits = sum(str(max(e["metadata"]["numbers"])) == str(e["answer"]) for e in rows)
    return (f" Answering the largest number given is right on {hits} of the {len(rows)} ID problems "
            f"({hits / len(rows):.3f}), a shortcut that needs no working.")


EXTRACTION_SAID = {
    "tag_or_number": ("our choice, not reasoning_gym's (which reads only an `<answer>` block): a completion without "
                      "an `<answer>` block is scored 1 if its last number equals the answer, else 0; a block is "
                      "scored by the task's own scorer (which can give partial credit)"),
    "tag": ("reasoning_gym's convention: the last `<answer>` block is scored by the task's own scorer (which can give "
            "partial credit), and a completion without one scores 0"),
}
"""How each ``extraction`` of ``scgrpo.data.ReasoningGymTask`` scores a completion, as the page says it."""


def round2_calibration(path: str = CALIBRATION) -> list[str]:
    """The base model on the reasoning_gym candidates (``scripts/calibrate_reasoning.py``'s file), the settings
    the second round trains on marked; nothing without the file."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    chosen = {setting_key(init["task"], init.get("config")) for init in map(reasoning_args, ROUND2_TASKS) if init}
    k, rows = data["results"][0]["samples"] if data["results"] else 8, []
    for r in data["results"]:
        used = setting_key(r["task"], r["config"]) in chosen
        rows.append([r["task"], f"`{json.dumps(r['config'])}`", f"{r['pass_at_k']:.2f}", f"{r['avg_at_k']:.3f}",
                     f"{r['mean_length']:.0f}", "-" if r["mean_correct_length"] is None else f"{r['mean_correct_length']:.0f}",
                     f"{r['truncated']:.2f}", "yes" if used else "no"])
    extraction = EXTRACTION_SAID.get(data["extraction"], "")
    return [f"The reasoning_gym settings: the base model's Pass@{k} and lengths (tokens) on the ID split's first "
            f"{data['results'][0]['rows']} problems of each setting (the same problems its evaluation uses first: "
            f"the split is drawn from the same seed), {k} samples, at most {data['max_new_tokens']} new tokens, on "
            f"{data['device']}; a setting suits when Pass@{k} is 10-60% and correct completions take 40 tokens or "
            f"more. Answers read with `extraction: {data['extraction']}`" + (f", {extraction}" if extraction else "")
            + ". The file keeps each setting's first right completion (`example_correct`): at this size a right last "
            "number often ends a confused working, and a completion cut at the token cap counts when its last number "
            "happens to be right (truncated: the share of all completions cut), so base Pass@"
            f"{k} is partly chance and the correct completions' length partly the cap. Command: `{data['command']}`.", "",
            *table(["task", "settings", f"Pass@{k}", f"Avg@{k}", "mean length", "mean correct length", "truncated",
                    "trained on"], rows)]


def subsection(title: str, body: list[str], caption: Optional[str] = None) -> list[str]:
    """A ``####`` heading over ``body`` and its caption, each followed by a blank line; nothing for an empty body."""
    if not body:
        return []
    return [f"#### {title}", "", *body, "", *([caption, ""] if caption else [])]


def round2(second: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The second round's section of the page."""
    out = ["## Second round: tasks where credit matters", ""]
    w = out.append
    w(f"Tasks {', '.join(ROUND2_TASKS)}; methods {', '.join(ROUND2_METHODS)}; seeds "
      f"{', '.join(map(str, ROUND2_SEEDS))}, each at its task config's learning rate. To reproduce: "
      f"`{ROUND2_COMMAND}`.")
    w("")
    for method in ROUND2_METHODS:
        w(f"- `{method}`: {LABELS[method]}")
    w("")
    w("### Setup")
    w("")
    for task, groups in second.items():
        if groups:
            out += round2_setup(task, groups)
    w("")
    calibration = round2_calibration()
    if calibration:
        out += calibration + [""]
    for task, groups in second.items():
        if not groups:
            continue
        w(f"### {task}")
        w("")
        out += round2_results(groups)
        w("")
        w(f"Mean ± standard deviation over seeds of the last evaluation. Completion length: the median over the last "
          f"{LAST} steps that trained of the rollouts' mean length, then over seeds. Steps trained, per seed: the "
          "steps that had a batch to learn from (DAPO skips a step whose groups all stay uniform after its extra "
          "sampling rounds). The last row is the first evaluation (before any step), averaged over every run of "
          "the task.")
        w("")
        out += subsection("Paired differences (same seed)", round2_paired(groups))
        out += subsection("Routes, KL and entropy", round2_signal(groups),
                          "Route shares: the mean over steps and seeds of each route's share of the groups. KL P50 / "
                          "P95 (the active tokens' KL to the self-teacher) and f mean: the median over steps, then the "
                          "mean over seeds. Entropy: the rollouts' mean token entropy at the first step, and its median "
                          f"over the last {LAST} steps; mean over seeds.")
        weights = round2_weights(groups)
        out += subsection("Where the weight goes", weights, weights_caption(groups) if weights else None)
        w(f"![{task}: entropy and completion length per step](replication/round2_{task}.png)")
        if concentration_methods(groups):
            w(f"![{task}: weight concentration per logged step](replication/round2_{task}_concentration.png)")
        w("")
    w("### What the second round shows")
    w("")
    out += round2_conclusions(second)
    w("")
    return out


def by_task(tasks: dict[str, dict[str, list[dict]]]) -> dict:
    """{method: {task: summary block}} over every task with results."""
    out: dict[str, dict] = {}
    for task, groups in tasks.items():
        for method, runs in groups.items():
            out.setdefault(method, {})[task] = summary_block(runs)
    return out


def draw_concentration(ax, runs: list[dict], method: str, colour: str) -> None:
    """A method's pooled concentration: the base-policy step as an open square per seed, then a line per seed over
    the later steps counted (:func:`counted_steps`), and their mean over seeds (:func:`trained`) dashed across
    them."""
    labelled: set[str] = set()

    def label(text: str) -> Optional[str]:
        new = text not in labelled
        labelled.add(text)
        return text if new else None

    for run in runs:
        base = base_concentration(run)
        if base is not None:
            ax.plot([int(base_step(run))], [base], ls="none", marker="s", ms=7, mfc="none", color=colour,
                    label=label(f"{method}, base policy (step {base_step(run)})"))
        later = [(step, b["concentration"]) for step, b in counted_steps(run)]
        if later:
            ax.plot(*zip(*later), color=colour, lw=0.9, alpha=0.6, marker="o", ms=3,
                    label=label(f"{method}, after it, per seed"))
    after = [t["concentration"] for t in (trained(r) for r in runs) if t]
    counted = [step for r in runs for step, _ in counted_steps(r)]
    if after:
        mean = statistics.fmean(after)
        ax.plot([min(counted), max(counted)], [mean, mean], color=colour, ls="--", marker="_", ms=14,
                label=f"{method}, after it: mean over seeds {mean:.2f}")


def round2_figures(second: dict[str, dict[str, list[dict]]], out: str) -> list[str]:
    """Per task: entropy and completion length per step (mean over seeds, a line per method), and the weight
    concentration per logged step of the SC-GRPO methods."""
    if not any(second.values()):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        written.append(path)

    for task, groups in second.items():
        if not groups:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, key, ylabel in ((axes[0], "entropy", "mean token entropy of the rollouts (nats)"),
                                (axes[1], "completion_length", "mean completion length (tokens)")):
            for method, runs in groups.items():
                steps, mean, _, _ = _series(runs, key)
                ax.plot(steps, mean, label=method)
            ax.set_xlabel("optimiser step")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task}: mean over seeds", fontsize=10)
        save(fig, f"round2_{task}.png")
        methods = concentration_methods(groups)
        if methods:
            fig, ax = plt.subplots(figsize=(7, 4.2))
            for k, method in enumerate(methods):
                draw_concentration(ax, groups[method], method, f"C{k}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xlabel("logged step")
            ax.set_ylabel("decision f share / decision token share")
            ax.set_title(f"{task}: weight concentration on decision tokens, all routes\n(logged steps with "
                         f"{MIN_TOKENS}+ teacher tokens; squares: the base policy's rollouts)", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            save(fig, f"round2_{task}_concentration.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default=RESULTS)
    parser.add_argument("--doc", default=DOC)
    parser.add_argument("--figures-dir", default=FIGURES)
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args()
    page, data, groups = report(args.results_dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
    with open(args.doc, "w") as f:
        f.write(page)
    with open(os.path.join(args.results_dir, "summary.json"), "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    written = [] if args.no_figures else (figures(groups, args.figures_dir)
                                          + round2_figures(round2_groups(load(args.results_dir)), args.figures_dir))
    print(f"wrote {args.doc}, {os.path.join(args.results_dir, 'summary.json')} and {len(written)} figure(s)")


if __name__ == "__main__":
    main()
