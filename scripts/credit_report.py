"""docs/credit.md from the credit comparison's files: ``benchmarks/results/credit/design.md`` (the design, fixed
before the runs), the calibrations and the result files of ``scripts/replicate.py --plan credit``
(``benchmarks/results/credit/runs/<run>.json``).

    python scripts/credit_report.py            # writes docs/credit.md
    python scripts/credit_report.py --check    # exits 1 when docs/credit.md is not what the files give

It also reanalyses the second replication round's stored weight shares (``benchmarks/results/replication/``) by
route. The page is a function of those files alone: running this again gives the same bytes (a test checks it). The
statistics (``paired_stats.py``) are the design's: per arm the learning-curve area (the mean id Avg@8 over the
evaluations after step 0), SC-GRPO against each other arm paired by seed with Holm-corrected t intervals and the
exact Wilcoxon signed-rank test, the smallest effect detectable at 80% power, and the pivot AUROC per seed; from
the runs' stored pivot rows, the AUROC and the concentration against a position-matched permutation null and
the concentration's seed -> step -> row bootstrap.
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
import paired_stats as ps  # noqa: E402
from replicate import CREDIT  # noqa: E402  (the arms)
from replication_report import load  # noqa: E402  (the result files of a folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CREDIT_DIR = os.path.join(ROOT, "benchmarks", "results", "credit")
DOC = os.path.join(ROOT, "docs", "credit.md")
TASK, PILOT = "doors_mixed", "doors"
"""The comparison's task and the first (pilot) task, whose runs saturated"""
SEEDS = 10
ALPHA = 0.05
REFERENCE = "scgrpo"
OTHERS = [m for m in CREDIT if m != REFERENCE]


def area(run: dict) -> Optional[float]:
    """The primary outcome: the mean id Avg@8 over the evaluations after step 0."""
    values = [e["id"]["avg@8"] for e in run["evaluations"] if e["step"] > 0 and "id" in e]
    return statistics.fmean(values) if values else None


def final_ood(run: dict) -> Optional[float]:
    scored = [e for e in run["evaluations"] if "ood" in e]
    return scored[-1]["ood"]["avg@8"] if scored else None


def pivots(run: dict, every: int = 5) -> tuple[Optional[float], Optional[float], int]:
    """The run's credit/pivot_auroc and credit/pivot_share averaged over its credit-logging steps that counted
    rows (steps 1, 1 + ``every``, ... of the result file, which scripts/replicate.py counts from 1: metrics.csv's
    steps 0, ``every``, ..., where ``log_completions_every_n_steps`` = ``every`` logs; the pilot's files repeat a
    logged value until the next one, so the other steps are not read), and the rows counted."""
    steps = run["steps"]
    aurocs, shares, rows = [], [], 0
    for k, step in enumerate(steps["step"]):
        counted = (steps.get("pivot_rows") or [None] * len(steps["step"]))[k]
        if step % every != 1 or not counted or counted != counted:
            continue
        rows += int(counted)
        for values, key in ((aurocs, "pivot_auroc"), (shares, "pivot_share")):
            value = steps[key][k]
            if value is not None and value == value:
                values.append(value)
    mean = (lambda xs: statistics.fmean(xs) if xs else None)
    return mean(aurocs), mean(shares), rows


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def by_arm(runs: list[dict], task: str) -> dict[str, dict[int, dict]]:
    arms: dict[str, dict[int, dict]] = {m: {} for m in CREDIT}
    for run in runs:
        if run["task"] == task and run["method"] in arms:
            arms[run["method"]][run["seed"]] = run
    return arms


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    return fmt(values[0]) if len(values) == 1 else f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def analysis(arms: dict[str, dict[int, dict]], found: Optional[dict] = None) -> list[str]:
    """The design's tables over the seeds every arm has; ``found`` (a dict) receives the primary outcome's tests
    for :func:`conclusions`."""
    lines = ["| arm | seeds | learning-curve area (mean ± sd) | ood Avg@8, last evaluation | pivot AUROC | pivot share | "
             "pivot rows |", "|---|---|---|---|---|---|---|"]
    for arm, runs in arms.items():
        seeds = sorted(runs)
        got = [pivots(runs[s]) for s in seeds]
        lines.append(f"| {arm} | {len(seeds)} | {mean_sd([area(runs[s]) for s in seeds])} | "
                     f"{mean_sd([v for v in (final_ood(runs[s]) for s in seeds) if v is not None])} | "
                     f"{mean_sd([a for a, _, _ in got if a is not None])} | "
                     f"{mean_sd([s_ for _, s_, _ in got if s_ is not None])} | {sum(n for _, _, n in got)} |")
    reference = arms[REFERENCE]
    tests = []
    for other in OTHERS:
        seeds = sorted(set(reference) & set(arms[other]))
        if len(seeds) >= 2:
            diffs = [area(reference[s]) - area(arms[other][s]) for s in seeds]
            tests.append((other, diffs, ps.paired_t(diffs)))
    lines += ["", f"**Primary outcome: SC-GRPO minus each arm, paired by seed** (Holm over the {len(tests)} "
              "comparisons; each interval at its Holm level; MDE: the smallest difference detectable with 80% "
              f"power at Holm's strictest level {ALPHA}/{len(OTHERS)}, from the observed spread)", ""]
    if not tests:
        return lines + ["No arm has two seeds paired with SC-GRPO yet."]
    adjusted, levels = ps.holm([t["p"] for _, _, t in tests], ALPHA)
    lines += ["| SC-GRPO minus | pairs | mean difference | sd | interval | level | p | Holm p | Wilcoxon p | MDE |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for (other, diffs, t), p_holm, level in zip(tests, adjusted, levels):
        at = ps.paired_t(diffs, 1 - level)
        wilcoxon = ps.wilcoxon_exact(diffs)
        mde = ps.detectable_effect(t["sd"], t["n"], ALPHA / len(OTHERS)) if t["sd"] > 0 else 0.0
        if found is not None:
            found.setdefault("primary", []).append({"other": other, "mean": t["mean"], "low": at["low"],
                                                    "high": at["high"], "holm_p": p_holm, "mde": mde, "n": t["n"]})
        lines.append(f"| {other} | {t['n']} | {t['mean']:+.4f} | {t['sd']:.4f} | [{at['low']:+.4f}, {at['high']:+.4f}] | "
                     f"{1 - level:.4f} | {fmt(t['p'])} | {fmt(p_holm)} | {fmt(wilcoxon)} | {mde:.4f} |")
    lines += ["", "**Mechanism: the pivot AUROC per seed** (the failed rows of partial-solve groups with a teacher; "
              "95% t intervals)", ""]
    per_seed = {arm: {s: pivots(r)[0] for s, r in runs.items()} for arm, runs in arms.items()}
    rows = ["| measure | seeds | mean | 95% interval | p | Wilcoxon p |", "|---|---|---|---|---|---|"]
    ref = {s: v for s, v in per_seed[REFERENCE].items() if v is not None}
    if len(ref) >= 2:
        t = ps.paired_t([v - 0.5 for v in ref.values()])
        rows.append(f"| SC-GRPO's AUROC (against 0.5) | {t['n']} | {t['mean'] + 0.5:.3f} | [{t['low'] + 0.5:.3f}, "
                    f"{t['high'] + 0.5:.3f}] | {ps_fmt(t['p'])} | "
                    f"{ps_fmt(ps.wilcoxon_exact([v - 0.5 for v in ref.values()]))} |")
    permuted = per_seed.get("scgrpo-permuted", {})
    seeds = sorted(s for s in ref if permuted.get(s) is not None)
    if len(seeds) >= 2:
        diffs = [ref[s] - permuted[s] for s in seeds]
        t = ps.paired_t(diffs)
        rows.append(f"| SC-GRPO minus permuted f | {t['n']} | {t['mean']:+.3f} | [{t['low']:+.3f}, {t['high']:+.3f}] | "
                    f"{ps_fmt(t['p'])} | {ps_fmt(ps.wilcoxon_exact(diffs))} |")
    lines += rows if len(rows) > 2 else ["Fewer than two seeds with pivot rows."]
    lines += ["", "| arm | " + " | ".join(f"seed {s}" for s in sorted({s for r in per_seed.values() for s in r})) + " |"]
    all_seeds = sorted({s for r in per_seed.values() for s in r})
    lines.append("|---|" + "---|" * len(all_seeds))
    for arm, values in per_seed.items():
        lines.append(f"| {arm} | " + " | ".join(fmt(values.get(s)) for s in all_seeds) + " |")
    return lines


def calibrations() -> list[str]:
    lines = []
    for path in sorted(glob.glob(os.path.join(CREDIT_DIR, "calibration*.json")) +
                       glob.glob(os.path.join(CREDIT_DIR, "calibration_round2", "*.json"))):
        with open(path) as f:
            data = json.load(f)
        name = os.path.relpath(path, ROOT)
        for candidate, splits in data["results"].items():  # (the first task's file predates "chosen")
            m = splits.get("id") or (splits if splits.get("split") == "id" else None)  # (the first file: one split)
            if m:
                lines.append(f"| `{name}` | {candidate} | {m.get('rows', 128)} x {m.get('samples', 8)} | {m['success']:.3f} | "
                             f"{m['moves']:.3f} | {m['right_moves']:.3f} | {m['partial_groups']:.2f} | "
                             f"{'**chosen**' if data.get('chosen', 'shots2-4') == candidate else ''} |")
    return ["| file | candidate | episodes | success | a door named | right moves | partial-solve groups | |",
            "|---|---|---|---|---|---|---|---|", *lines]


REPLICATION = os.path.join(ROOT, "benchmarks", "results", "replication")
ROUND2 = ["chain_sum", "lcm", "tool_calc", "blackjack"]
"""The second replication round's tasks (docs/replication.md), whose SC-GRPO runs hold weight shares by route"""
BOOTSTRAP, MIN_TOKENS = 2000, 100


def route_steps(run: dict, route: str) -> list[tuple[float, int]]:
    """(log concentration, decision tokens) of each logged step of a route after the base-policy step (the first
    logged one) with ``MIN_TOKENS`` teacher tokens or more, from the run's stored weight shares."""
    by_step = (run.get("weight_shares") or {}).get("by_step", {})
    steps = sorted(by_step, key=int)[1:]
    out = []
    for step in steps:
        block = by_step[step].get(route)
        if block and block["tokens"] >= MIN_TOKENS and block.get("concentration") and block["decision_tokens"]:
            out.append((math.log(block["concentration"]), block["decision_tokens"]))
    return out


def weighted(seeds: list[list[tuple[float, int]]]) -> float:
    """The decision-token-weighted mean of log concentration over every step of every seed."""
    total = sum(w for steps in seeds for _, w in steps)
    return sum(v * w for steps in seeds for v, w in steps) / total


def cluster_bootstrap(seeds: list[list[tuple[float, int]]], rng) -> tuple[float, float]:
    """The 95% percentile interval of :func:`weighted` resampling seeds, then steps within each drawn seed."""
    draws = []
    for _ in range(BOOTSTRAP):
        picked = [seeds[rng.randrange(len(seeds))] for _ in seeds]
        draws.append(weighted([[steps[rng.randrange(len(steps))] for _ in steps] for steps in picked]))
    draws.sort()
    return draws[int(0.025 * BOOTSTRAP)], draws[int(0.975 * BOOTSTRAP) - 1]


def reanalysis(replication_dir: str) -> list[str]:
    """Round two's SC-GRPO weight by route, from the stored per-step aggregates (item 6 as far as they allow)."""
    import random

    runs = [r for r in load(replication_dir) if r.get("method") == "scgrpo" and r.get("task") in ROUND2]
    lines = ["| task | route | seeds | steps | decision tokens | concentration (token-weighted, geometric) | "
             "95% interval (seed -> step bootstrap) |", "|---|---|---|---|---|---|---|"]
    for task in ROUND2:
        for route in ("partial", "solve_none", "pooled"):
            seeds = [steps for steps in (route_steps(r, route) for r in sorted(
                (r for r in runs if r["task"] == task), key=lambda r: r["seed"])) if steps]
            if not seeds:
                lines.append(f"| {task} | {route} | 0 | 0 | 0 | - | - |")
                continue
            low, high = cluster_bootstrap(seeds, random.Random(f"{task}-{route}"))
            lines.append(f"| {task} | {route} | {len(seeds)} | {sum(len(s) for s in seeds)} | "
                         f"{sum(w for s in seeds for _, w in s)} | {math.exp(weighted(seeds)):.3f} | "
                         f"[{math.exp(low):.3f}, {math.exp(high):.3f}] |")
    return lines


WRONG, RIGHT = 2, 1
"""scgrpo.pivots' labels of a wrong and a right decision token (0: none, 3: a token holding both)"""
NULL_DRAWS, POSITION_BINS = 1000, 4
TOKEN_ARMS = ["scgrpo", "scgrpo-permuted"]


def pivot_steps(run: dict) -> list[list[dict]]:
    """The run's stored pivot rows (``pivot_tokens``: failed rows of partial-solve groups with a teacher that
    mark a decision; per row its f and labels at its model tokens) grouped by step, in step order."""
    by_step: dict[int, list[dict]] = {}
    for row in run.get("pivot_tokens") or []:
        by_step.setdefault(row["step"], []).append(row)
    return [by_step[step] for step in sorted(by_step)]


def row_masses(row: dict) -> tuple[float, float, int, int]:
    """A row's (f mass, f mass on decision tokens, model tokens, decision tokens)."""
    f, decision = row["f"], row["decision"]
    return sum(f), sum(v for v, d in zip(f, decision) if d), len(f), sum(1 for d in decision if d)


def step_concentration(rows: list[dict]) -> Optional[tuple[float, int]]:
    """(log concentration, decision tokens) of a step: the decision tokens' share of the f mass over their share
    of the model tokens; None where it is undefined."""
    return masses_concentration([row_masses(r) for r in rows])


def masses_concentration(masses: list[tuple[float, float, int, int]]) -> Optional[tuple[float, int]]:
    """:func:`step_concentration` of the rows whose :func:`row_masses` are ``masses``."""
    mass = sum(m[0] for m in masses)
    decision_mass = sum(m[1] for m in masses)
    tokens = sum(m[2] for m in masses)
    decisions = sum(m[3] for m in masses)
    if mass <= 0 or decision_mass <= 0 or not decisions:
        return None
    return math.log((decision_mass / mass) / (decisions / tokens)), decisions


def position_bins(n: int) -> list[int]:
    """Each of a row's n model tokens' relative-position bin (``POSITION_BINS`` equal parts of the row)."""
    return [min(POSITION_BINS - 1, k * POSITION_BINS // n) for k in range(n)]


def _step_arrays(rows: list[dict]):
    import numpy as np

    f = np.array([v for r in rows for v in r["f"]], dtype=float)
    labels = np.array([d for r in rows for d in r["decision"]])
    bins = np.array([k for r in rows for k in position_bins(len(r["f"]))])
    return f, labels, bins


def position_permuted(f, bins, draws: int, rng):
    """``[draws, tokens]``: the step's f shuffled among its tokens of the same relative-position bin, each draw
    its own shuffle (the labels stay where they are)."""
    import numpy as np

    out = np.empty((draws, f.size))
    for k in np.unique(bins):
        where = np.flatnonzero(bins == k)
        out[:, where] = rng.permuted(np.tile(f[where], (draws, 1)), axis=1)
    return out


def auroc_draws(F, labels):
    """The AUROC of each row of ``F`` (``[draws, tokens]``) at the wrong-decision tokens against the right ones
    (None where either is missing)."""
    wrong, right = F[:, labels == WRONG], F[:, labels == RIGHT]
    if not wrong.shape[1] or not right.shape[1]:
        return None
    diff = wrong[:, :, None] - right[:, None, :]
    return ((diff > 0) + 0.5 * (diff == 0)).mean(axis=(1, 2))


def concentration_draws(F, labels):
    """(log concentration of each row of ``F``, decision tokens), or None where the observed is undefined."""
    import numpy as np

    decisions = int((labels != 0).sum())
    mass, decision_mass = F.sum(axis=1), F[:, labels != 0].sum(axis=1)
    if not decisions or (decision_mass <= 0).any() or (mass <= 0).any():
        return None
    return np.log((decision_mass / mass) / (decisions / labels.size)), decisions


def position_null(seeds: list[list[list[dict]]], kind: str, rng) -> tuple[float, float, float]:
    """The seeds' mean statistic (``kind``: the run's mean step AUROC, or its decision-token-weighted mean log
    concentration), its mean under the position-matched permutation null (``NULL_DRAWS`` draws), and the
    one-sided p of a null draw at or above the observed."""
    import numpy as np

    observed, null = [], []
    for steps in seeds:
        values, draws, weights = [], [], []
        for rows in steps:
            f, labels, bins = _step_arrays(rows)
            F = np.vstack([f[None, :], position_permuted(f, bins, NULL_DRAWS, rng)])  # row 0: as observed
            if kind == "auroc":
                out = auroc_draws(F, labels)
                if out is not None:
                    values.append(out)
                    weights.append(1)
            else:
                out = concentration_draws(F, labels)
                if out is not None:
                    values.append(out[0])
                    weights.append(out[1])
        if values:
            per_run = np.average(np.vstack(values), axis=0, weights=weights)
            observed.append(per_run[0])
            null.append(per_run[1:])
    obs, draws = float(np.mean(observed)), np.mean(np.vstack(null), axis=0)
    return obs, float(draws.mean()), float((1 + (draws >= obs - 1e-12).sum()) / (1 + NULL_DRAWS))


def row_bootstrap(seeds: list[list[list[dict]]], rng) -> tuple[float, float]:
    """The 95% percentile interval of the decision-token-weighted mean log concentration, resampling seeds, then
    steps within each drawn seed, then rows within each drawn step."""
    seeds = [[[row_masses(r) for r in step] for step in steps] for steps in seeds]  # (summed once, drawn often)
    draws = []
    for _ in range(BOOTSTRAP):
        picked = [seeds[rng.randrange(len(seeds))] for _ in seeds]
        blocks = [[c for c in (masses_concentration([step[rng.randrange(len(step))] for _ in step])
                               for step in (steps[rng.randrange(len(steps))] for _ in steps)) if c is not None]
                  for steps in picked]
        if any(blocks):
            draws.append(weighted(blocks))
    draws.sort()
    return draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def row_turns(row: dict, rooms: Optional[int]) -> Optional[list[int]]:
    """Each model token's turn: the row's stored ``turn``, or, in files written before it was stored, the order of
    the decision a token belongs to (each doors turn marks one move) where the row holds ``rooms`` runs of
    decision tokens; None where that does not say (two moves' tokens adjacent once the observations between
    them are dropped, or a turn without a move)."""
    if row.get("turn") is not None:
        return row["turn"]
    turns, k, previous = [], -1, 0
    for d in row["decision"]:
        k += bool(d and not previous)
        turns.append(k)
        previous = d
    return turns if k + 1 == rooms else None


def decision_runs(row: dict) -> int:
    return sum(1 for k, d in enumerate(row["decision"]) if d and (k == 0 or not row["decision"][k - 1]))


def step_auroc(rows: list[dict], strata: Optional[list[Optional[list[int]]]] = None) -> Optional[float]:
    """The AUROC of f at a step's wrong-decision tokens against its right ones, pooled over ``strata`` (per row, a
    stratum per token, or None: the row left out) when given: each stratum's pairs alone."""
    import numpy as np

    wins = pairs = 0.0
    keys = strata if strata is not None else [[0] * len(r["f"]) for r in rows]
    groups: dict = {}
    for r, key in zip(rows, keys):
        if key is None:
            continue
        for f, d, k in zip(r["f"], r["decision"], key):
            if d in (WRONG, RIGHT):
                groups.setdefault(k, ([], []))[d == RIGHT].append(f)
    for wrong, right in groups.values():
        if wrong and right:
            diff = np.array(wrong)[:, None] - np.array(right)[None, :]
            wins += float(((diff > 0) + 0.5 * (diff == 0)).sum())
            pairs += diff.size
    return wins / pairs if pairs else None


AUROC_KINDS = {"pooled": "pooled", "turn": "within turns", "row": "within rows"}


def run_aurocs(steps: list[list[dict]]) -> dict[str, Optional[float]]:
    """The run's mean step AUROC of each kind (pooled; within turns; within rows), over the steps with pairs."""
    counts = [decision_runs(r) for rows in steps for r in rows]
    rooms = max(set(counts), key=counts.count) if counts else None  # (the rooms: every turn marks one move)
    out = {}
    for kind in AUROC_KINDS:
        values = []
        for rows in steps:
            strata = {"pooled": None, "turn": [row_turns(r, rooms) for r in rows],
                      "row": [[i] * len(r["f"]) for i, r in enumerate(rows)]}[kind]
            value = step_auroc(rows, strata)
            if value is not None:
                values.append(value)
        out[kind] = statistics.fmean(values) if values else None
    return out


def stratified_table(arms: dict[str, dict[int, dict]], found: Optional[dict] = None) -> list[str]:
    """Per arm and kind the seeds' mean step AUROC with its t interval, and SC-GRPO minus the permuted arm, paired
    by seed."""
    per = {arm: {seed: run_aurocs(pivot_steps(run)) for seed, run in sorted(arms.get(arm, {}).items())}
           for arm in TOKEN_ARMS}
    lines = ["| AUROC | arm | seeds | mean | 95% interval | p (against 0.5) | Wilcoxon p |", "|---|---|---|---|---|---|---|"]
    for kind, name in AUROC_KINDS.items():
        for arm in TOKEN_ARMS:
            values = [v[kind] for v in per[arm].values() if v[kind] is not None]
            if len(values) < 2:
                lines.append(f"| {name} | {arm} | {len(values)} | {fmt(values[0] if values else None)} | - | - | - |")
                continue
            t = ps.paired_t([v - 0.5 for v in values])
            lines.append(f"| {name} | {arm} | {t['n']} | {t['mean'] + 0.5:.3f} | [{t['low'] + 0.5:.3f}, "
                         f"{t['high'] + 0.5:.3f}] | {ps_fmt(t['p'])} | {ps_fmt(ps.wilcoxon_exact([v - 0.5 for v in values]))} |")
            if found is not None:
                found.setdefault("auroc", {})[(kind, arm)] = {**t, "mean": t["mean"] + 0.5, "low": t["low"] + 0.5,
                                                               "high": t["high"] + 0.5}
        seeds = [s for s in per[REFERENCE] if per[REFERENCE][s][kind] is not None
                 and per["scgrpo-permuted"].get(s, {}).get(kind) is not None]
        if len(seeds) >= 2:
            diffs = [per[REFERENCE][s][kind] - per["scgrpo-permuted"][s][kind] for s in seeds]
            t = ps.paired_t(diffs)
            lines.append(f"| {name} | SC-GRPO minus permuted | {t['n']} | {t['mean']:+.3f} | [{t['low']:+.3f}, "
                         f"{t['high']:+.3f}] | {ps_fmt(t['p'])} (against 0) | {ps_fmt(ps.wilcoxon_exact(diffs))} |")
            if found is not None:
                found.setdefault("auroc", {})[(kind, "minus permuted")] = t
    return lines


def ps_fmt(p: Optional[float]) -> str:
    """A p-value: three decimals, or "<0.001"."""
    return "-" if p is None or p != p else ("<0.001" if p < 0.001 else f"{p:.3f}")


def conclusions(found: dict) -> list[str]:
    """What the runs say, in sentences made from the tests: the primary outcome per arm, then the mechanism."""
    lines = []
    for t in found.get("primary", []):
        shown = t["holm_p"] < ALPHA
        lines.append(f"- **SC-GRPO against {t['other']}** ({t['n']} paired seeds): learning-curve area "
                     f"{t['mean']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}] (Holm p {ps_fmt(t['holm_p'])}): "
                     + ("a difference at the family level 0.05." if shown else
                        "no difference shown at the family level 0.05; ")
                     + ("" if shown else f"these runs would have found one of {t['mde']:.4f} or more with 80% power"
                        + (", so a gain of the paper's size (about +0.04) could have gone unseen." if t["mde"] > 0.04
                           else ", which a gain of the paper's size (about +0.04) exceeds.")))
    auroc = found.get("auroc", {})
    for kind, name in AUROC_KINDS.items():
        ref, diff = auroc.get((kind, REFERENCE)), auroc.get((kind, "minus permuted"))
        if ref is None:
            continue
        text = (f"- **Pivot AUROC, {name}**: SC-GRPO {ref['mean']:.3f} [{ref['low']:.3f}, {ref['high']:.3f}]"
                f" ({'above' if ref['low'] > 0.5 else 'below' if ref['high'] < 0.5 else 'not distinguished from'} 0.5)")
        if diff is not None:
            text += (f"; minus the permuted arm {diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]: where "
                     "the permuted-f arm's weight lands " + (
                         "differs from SC-GRPO's." if diff["low"] > 0 or diff["high"] < 0 else
                         "is not distinguished from SC-GRPO's."))
        lines.append(text)
    return lines


def token_analysis(arms: dict[str, dict[int, dict]]) -> list[str]:
    """Item 6 on the comparison's own pivot rows: the AUROC and the concentration against a position-matched
    permutation null, and the concentration's seed -> step -> row bootstrap (steps weighted by decision tokens)."""
    import random
    import zlib

    import numpy as np

    lines = ["| arm | seeds | steps | rows | AUROC (mean of seeds) | position null | p | concentration "
             "(token-weighted, geometric) | 95% interval (seed -> step -> row) | position null | p |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in TOKEN_ARMS:
        seeds = [steps for steps in (pivot_steps(run) for _, run in sorted(arms.get(arm, {}).items())) if steps]
        if not seeds:
            lines.append(f"| {arm} | 0 | 0 | 0 | - | - | - | - | - | - | - |")
            continue
        auroc, auroc_null, auroc_p = position_null(seeds, "auroc", np.random.default_rng(zlib.crc32(f"{arm}-auroc".encode())))
        conc, conc_null, conc_p = position_null(seeds, "concentration",
                                                np.random.default_rng(zlib.crc32(f"{arm}-concentration".encode())))
        low, high = row_bootstrap(seeds, random.Random(f"{arm}-rows"))
        lines.append(f"| {arm} | {len(seeds)} | {sum(len(s) for s in seeds)} | "
                     f"{sum(len(step) for s in seeds for step in s)} | {auroc:.3f} | {auroc_null:.3f} | {auroc_p:.3f} | "
                     f"{math.exp(conc):.3f} | [{math.exp(low):.3f}, {math.exp(high):.3f}] | {math.exp(conc_null):.3f} | "
                     f"{conc_p:.3f} |")
    return lines


def report(results_dir: str, replication_dir: str = REPLICATION) -> str:
    runs = load(results_dir)
    with open(os.path.join(CREDIT_DIR, "design.md")) as f:
        design = f.read().strip()
    main = by_arm(runs, TASK)
    done = sum(len(r) for r in main.values())
    found: dict = {}
    lines = ["# Does the weight land on the decisions? The credit comparison", "",
             "Generated by `python scripts/credit_report.py` from `benchmarks/results/credit/` (the design, the "
             "calibrations and the runs of `python scripts/replicate.py --plan credit`); do not edit by hand.", "",
             design, "", f"## The comparison (`{TASK}`)", ""]
    if done < len(CREDIT) * SEEDS:
        lines += [f"**Not yet run in full: {done} of {len(CREDIT) * SEEDS} runs** ({len(CREDIT)} arms x {SEEDS} seeds) "
                  "have results. No conclusion is drawn from this section until every run has one.", ""]
    if done:
        lines += ["GRPO has no teacher (no pivot keys); scaled GRPO weighs every token of a row alike (AUROC 0.5, "
                  "share 1 by construction).", "",
                  "What a policy gets without the one comparison: the first of the two rooms names the key's door, "
                  "so a reply that copies the room's door name is always right there, and one that copies the "
                  "second room's first door name is right half the time: 0.5 an episode "
                  "(`tests/envs/test_doors.py::test_echoing_the_room_text_solves_what_can_be_copied_and_no_more`), "
                  "against 0.25 for a constant door. The task's one decision that cannot be copied is its numbered "
                  "room, and an area above 0.5 needs that comparison.", ""]
        lines += analysis(main, found)
        lines += ["", "**Where the weight goes, token by token** (the stored pivot rows of each run: failed rows of "
                  "partial-solve groups with a teacher, the credit-logging steps; rank 0's rows). Against a "
                  f"position-matched null: f shuffled among a step's tokens in the same of {POSITION_BINS} "
                  f"relative-position bins of their rows ({NULL_DRAWS:,} draws, seeded), the labels kept; p: the "
                  "share of draws at or above the observed. The AUROC is averaged over a run's steps, then over "
                  "seeds; the concentration (the decision tokens' share of the f mass over their share of the "
                  "tokens) as logs weighted by each step's decision tokens, with a seed -> step -> row bootstrap "
                  f"({BOOTSTRAP:,} draws, seeded). Where the decisions always sit at the same positions (here the "
                  "first token of each turn), the position null holds the concentration near its observed value. "
                  "It does not free the AUROC from position: the named room comes first and the numbered one, "
                  "the one a failed episode gets wrong, second, so wrong moves are mostly late tokens and right ones "
                  "early; a weight that grows along the episode separates them without telling a wrong move from a "
                  "right one. The table after it holds the comparison within each turn, and within each row.", "",
                  *token_analysis(main), "",
                  "**The AUROC with position and row level held** (the same stored rows): within turns, a wrong "
                  "move's tokens against right moves' tokens of the same turn (any row); within rows, a row's wrong "
                  "moves against its own right ones; each a step's pairs pooled over its strata, averaged over a "
                  "run's steps, then over seeds (95% t intervals over seeds). Files written before each token's "
                  "turn was stored give it by the order of its row's moves (each turn marks one), where the row "
                  "holds one run of move tokens a room; the other rows are left out of the within-turn AUROC. On this task "
                  "the within-turn AUROC is the one that holds position: within a row the wrong move is mostly the "
                  "later one, so the within-row AUROC takes out each row's level of f but keeps the position.", "",
                  *stratified_table(main, found)]
        if done >= len(CREDIT) * SEEDS:
            lines += ["", "## What the runs say", "", *conclusions(found)]
    lines += ["", f"## The pilot (`{PILOT}`: every room names the key's door)", "",
              "The same analysis over the pilot's seeds (120 steps, evaluated every 25: its last evaluation is step 100's). Its id Avg@8 reached its ceiling by step 25 in every arm, so "
              "its primary outcome cannot tell the arms apart, and its pivot rows come from the first steps only. "
              "GRPO has no teacher (no pivot keys); scaled GRPO weighs every token of a row alike (AUROC 0.5, share 1 "
              "by construction).", ""]
    lines += analysis(by_arm(runs, PILOT))
    lines += ["", "## Calibrations (the untrained model, id split, T = 1)", "", *calibrations(), "",
              "## The second replication round, reanalysed from its stored aggregates", "",
              "SC-GRPO's runs of docs/replication.md's second round (paper defaults, lr 2e-4): per route, the "
              "concentration (the decision tokens' share of the f mass over their share of the teacher tokens, 1: "
              "no more weight on decisions than uniform weights give) of each logged step after the base-policy step "
              f"with {MIN_TOKENS} teacher tokens or more, averaged as logs with each step weighted by its decision "
              "tokens; the interval resamples seeds, then steps within them (2,000 draws, seeded; with one seed, its steps alone). The decision "
              "tokens are each task's rule of scripts/weight_shares.py (digits and operators, tool calls, moves), "
              "not marked pivots.", "", *reanalysis(replication_dir), "",
              "What the aggregates cannot give: a position-matched permutation null (f shuffled among tokens at the "
              "same relative position) and the row level of the bootstrap need each token's f, and the runs' "
              "credit_tokens.jsonl files were not kept; only per-step sums by route were.", "",
              "## Not yet here", "",
              f"- {len(CREDIT) * SEEDS - done} of the comparison's {len(CREDIT) * SEEDS} runs (above)." if done < len(CREDIT) * SEEDS
              else "- Nothing of the comparison: every run has its result."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", default=os.path.join(CREDIT_DIR, "runs"))
    parser.add_argument("--replication-dir", default=REPLICATION)
    parser.add_argument("--out", default=DOC)
    parser.add_argument("--check", action="store_true", help="exit 1 when --out is not what the files give")
    args = parser.parse_args(argv)
    text = report(args.results_dir, args.replication_dir)
    if args.check:
        with open(args.out) as f:
            same = f.read() == text
        print("up to date" if same else f"{args.out} differs from what the files give: run scripts/credit_report.py")
        return 0 if same else 1
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
