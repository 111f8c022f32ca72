"""Plots of a run's training curves over steps, from its ``metrics.csv``: reward, evaluation accuracy, completion
length and entropy.

    python scripts/plot_run.py runs/scgrpo_arith/version_0 [runs/grpo_arith/version_0 ...] [--out plots/]

RUN is a run folder (``runs/<name>/version_N``, the one that holds ``metrics.csv``) or a ``metrics.csv`` file. The
PNG files go to ``--out``; for one RUN it defaults to ``plots/`` in RUN's folder (``runs/<name>/version_N/plots``),
several RUNs need it. Writes ``reward.png`` (train/reward, the mean reward of the step's rollouts, with a band of
plus or minus train/reward_std where that is logged), ``accuracy.png`` (val/<split>/avg@k of each evaluation split:
the mean accuracy of k sampled completions a prompt), ``completion_length.png`` (train/completion_length, and
val/<split>/completion_length marked) and ``entropy.png`` (policy/entropy, the mean token entropy of the sampled
responses). Several runs (seeds, or methods) are drawn on the same axes, labelled by their folder; steps are ticked
in whole numbers. ``scripts/plot_credit.py`` draws the self-teacher's signal (SC-GRPO's credit/* keys).

A figure with nothing to draw is not written (accuracy.png in a run without validation, for example), and a run
without a figure's values beside runs with them is left out of it; both are said on stderr. With nothing to draw
at all the script ends with status 1. It needs matplotlib: ``pip install -e '.[plots]'``.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (scripts/ is not a package)
from plot_credit import _has, _label, _save, pyplot, read_series  # noqa: E402

TRAIN = ("train/reward", "train/reward_std", "train/completion_length", "policy/entropy")
ACCURACY = re.compile(r"val/([^/]+)/(avg@\d+|accuracy)")  # (evaluation.py logs avg@k; accuracy if a run has it)
FIGURES = {  # each figure: which of a run's keys it draws (from its columns), and in words
    "reward.png": (lambda columns: ["train/reward"], "train/reward"),
    "accuracy.png": (lambda columns: list(accuracy_keys(columns).values()), "val/<split>/avg@k"),
    "completion_length.png": (lambda columns: ["train/completion_length", *length_keys(columns).values()],
                              "train/completion_length or val/<split>/completion_length"),
    "entropy.png": (lambda columns: ["policy/entropy"], "policy/entropy"),
}
SPLIT_STYLES = (("-", "o", 7), ("--", "s", 4), ("-.", "^", 6), (":", "D", 3))  # (line, marker, size) of each split
# (hollow markers of two sizes: a split's points stay in sight under another's with the same values)


def _note(message: str) -> None:
    print(f"plot_run.py: {message}", file=sys.stderr)


def metrics_path(run: str) -> str:
    """The ``metrics.csv`` of ``run``: the file itself, or the one in the run folder."""
    return os.path.join(run, "metrics.csv") if os.path.isdir(run) else run


def columns_of(path: str) -> list[str]:
    """The header of a ``metrics.csv``."""
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def accuracy_keys(columns: list[str]) -> dict[str, str]:
    """``{split: key}`` of the evaluation accuracy columns, in the order of the header: ``val/<split>/avg@k``
    (``val/<split>/accuracy`` where a split has no avg@k)."""
    keys: dict[str, str] = {}
    for column in columns:
        match = ACCURACY.fullmatch(column)
        if match and (match.group(1) not in keys or match.group(2) != "accuracy"):
            keys[match.group(1)] = column
    return keys


def length_keys(columns: list[str]) -> dict[str, str]:
    """``{split: key}`` of the evaluation completion-length columns, ``val/<split>/completion_length``."""
    return {c.split("/")[1]: c for c in columns if re.fullmatch(r"val/[^/]+/completion_length", c)}


def read_run(path: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` of the keys the figures draw (train/*, policy/entropy, val/<split>/avg@k and
    completion_length), for the rows of ``path`` where the key has a finite value; a key not in the header has
    none."""
    columns = columns_of(path)
    keys = TRAIN + tuple(accuracy_keys(columns).values()) + tuple(length_keys(columns).values())
    return read_series(path, keys)


def _colour(run: int, series: int, several_runs: bool) -> str:
    """A run's colour where several are drawn, else the series' own (one run: a colour per split)."""
    return f"C{run if several_runs else series}"


def plot(paths: list[str], out: str) -> list[str]:
    """Draws the figures that have something to draw for the ``metrics.csv`` files ``paths`` into the folder
    ``out``; returns the files written. A figure left out, and a run left out of figures that others are in, are
    said on stderr."""
    columns = {p: columns_of(p) for p in paths}
    runs = {p: read_run(p) for p in paths}
    drawn = {name: [p for p in paths if _has(runs[p], tuple(keys(columns[p])))]
             for name, (keys, _) in FIGURES.items()}
    for name, (_, what) in FIGURES.items():
        why = " (the run's validation logs them, a split of data.eval_splits each)" if name == "accuracy.png" else ""
        if not drawn[name]:
            _note(f"{name} not written: no {what} values in {', '.join(paths)}{why}")
        elif len(drawn[name]) < len(paths):
            left_out = [p for p in paths if p not in drawn[name]]
            _note(f"{', '.join(left_out)} left out of {name}: no {what} values{why}")
    if not any(drawn.values()):
        return []
    plt = pyplot("plot_run.py")
    os.makedirs(out, exist_ok=True)
    several = len(paths) > 1
    suffix = "" if several else f" ({_label(paths[0])})"
    written: list[str] = []

    if drawn["reward.png"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, path in enumerate(paths):
            steps, values = runs[path]["train/reward"]
            if not steps:
                continue
            ax.plot(steps, values, color=f"C{i}", label=_label(path) if several else "train/reward",
                    marker="o" if len(steps) < 30 else None, markersize=3)
            std = dict(zip(*runs[path]["train/reward_std"]))
            band = [(s, v, std[s]) for s, v in zip(steps, values) if s in std]
            if band:
                ax.fill_between([s for s, _, _ in band], [v - d for _, v, d in band], [v + d for _, v, d in band],
                                color=f"C{i}", alpha=0.2, linewidth=0,
                                label="± train/reward_std" + (f" ({_label(path)})" if several else ""))
        _save(plt, fig, ax, "reward (mean of the step's rollouts)", f"Training reward{suffix}",
              os.path.join(out, "reward.png"), written)

    if drawn["accuracy.png"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        splits = list(dict.fromkeys(s for p in paths for s in accuracy_keys(columns[p])))  # (first seen, first)
        for i, path in enumerate(paths):
            for split, key in accuracy_keys(columns[path]).items():
                steps, values = runs[path][key]
                if steps:
                    j = splits.index(split)
                    line, marker, size = SPLIT_STYLES[j % len(SPLIT_STYLES)]
                    label = f"{split} {key.split('/')[-1]}" + (f" ({_label(path)})" if several else "")
                    ax.plot(steps, values, linestyle=line, marker=marker, markersize=size, markerfacecolor="none",
                            color=_colour(i, j, several), label=label)
        ax.set_ylim(-0.02, 1.02)
        _save(plt, fig, ax, "accuracy (mean over k samples a prompt)", f"Evaluation accuracy by split{suffix}",
              os.path.join(out, "accuracy.png"), written)

    if drawn["completion_length.png"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        splits = list(dict.fromkeys(s for p in paths for s in length_keys(columns[p])))
        for i, path in enumerate(paths):
            steps, values = runs[path]["train/completion_length"]
            if steps:
                ax.plot(steps, values, color=_colour(i, 0, several),
                        label="train" + (f" ({_label(path)})" if several else ""))
            for split, key in length_keys(columns[path]).items():
                steps, values = runs[path][key]
                if steps:
                    j = splits.index(split)
                    line, marker, size = SPLIT_STYLES[(j + 1) % len(SPLIT_STYLES)]  # (train's is the solid line)
                    ax.plot(steps, values, linestyle=line, marker=marker, markersize=size, markerfacecolor="none",
                            color=_colour(i, j + 1, several),
                            label=f"val {split}" + (f" ({_label(path)})" if several else ""))
        ax.set_ylim(bottom=0)
        _save(plt, fig, ax, "tokens per completion", f"Completion length{suffix}",
              os.path.join(out, "completion_length.png"), written)

    if drawn["entropy.png"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, path in enumerate(paths):  # (a run's colour is the same in every figure)
            steps, values = runs[path]["policy/entropy"]
            if steps:
                ax.plot(steps, values, color=f"C{i}", label=_label(path) if several else "policy/entropy")
        _save(plt, fig, ax, "nats per token", f"Policy entropy of the sampled responses{suffix}",
              os.path.join(out, "entropy.png"), written)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run folder(s) (runs/<name>/version_N) or their metrics.csv files")
    parser.add_argument("--out", help="folder for the PNG files (default, for one RUN: plots/ in its folder)")
    args = parser.parse_args(argv)
    paths = [metrics_path(run) for run in args.runs]
    for run, path in zip(args.runs, paths):
        if not os.path.isfile(path):
            parser.error(f"{run} is not a metrics.csv file or a run folder that holds one")
    if args.out is None and len(paths) > 1:
        parser.error("--out is needed with several runs")
    out = args.out if args.out is not None else os.path.join(os.path.dirname(paths[0]), "plots")
    written = plot(paths, out)
    if not written:
        raise SystemExit(f"plot_run.py: error: nothing to plot in {', '.join(paths)}")
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
