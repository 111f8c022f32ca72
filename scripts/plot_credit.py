"""Plots of a run's self-teacher signal over training steps, from its ``metrics.csv``.

    python scripts/plot_credit.py runs/scgrpo_arith/version_0/metrics.csv --out plots/

Writes ``kl_percentiles.png`` (credit/kl_p25, p50, p75, p95 and c, log scale), ``entropy.png``
(policy/entropy, the mean token entropy of the sampled responses) and ``routes.png`` (the share of groups in
each route). Several CSV files (seeds, or methods) are drawn on the same axes, labelled by their folder.
"""

from __future__ import annotations

import argparse
import csv
import math
import os

PERCENTILES = ("credit/kl_p25", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95")
ROUTES = ("credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all")


def read_series(path: str, keys: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for the rows of a Lightning ``metrics.csv`` where the key has a finite value."""
    series: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k in keys}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            for key in keys:
                value = row.get(key)
                if step in (None, "") or value in (None, ""):
                    continue
                number = float(value)
                if math.isfinite(number):
                    series[key][0].append(int(float(step)))
                    series[key][1].append(number)
    return series


def _label(path: str) -> str:
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    return "/".join(parts[-3:-1]) if len(parts) >= 3 else path


def _save(fig, ax, ylabel: str, title: str, path: str, written: list[str]) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)


def plot(paths: list[str], out: str) -> list[str]:
    """Draws the three figures for ``paths`` into the folder ``out``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    written = []
    runs = {p: read_series(p, PERCENTILES + ROUTES + ("credit/c", "policy/entropy")) for p in paths}

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (path, series) in enumerate(runs.items()):
        for key, style in zip(PERCENTILES + ("credit/c",), (":", "--", "-", "-.", "-")):
            steps, values = series[key]
            if steps:
                label = key.split("/")[-1] + (f" ({_label(path)})" if len(runs) > 1 else "")
                ax.plot(steps, values, style, color=f"C{PERCENTILES.index(key) if key in PERCENTILES else 4}",
                        alpha=1.0 if i == 0 else 0.6, label=label, linewidth=2 if key == "credit/c" else 1)
    ax.set_yscale("log")
    _save(fig, ax, "KL(teacher || policy) per token", "Self-teacher divergence of active tokens, and c",
          os.path.join(out, "kl_percentiles.png"), written)

    fig, ax = plt.subplots(figsize=(7, 4))
    for path, series in runs.items():
        steps, values = series["policy/entropy"]
        if steps:
            ax.plot(steps, values, label=_label(path))
    _save(fig, ax, "nats per token", "Policy entropy of the sampled responses", os.path.join(out, "entropy.png"), written)

    fig, ax = plt.subplots(figsize=(7, 4))
    first = next(iter(runs.values()))
    for key in ROUTES:
        steps, values = first[key]
        if steps:
            ax.plot(steps, values, label=key.split("route_")[-1])
    ax.set_ylim(0, 1)
    _save(fig, ax, "share of groups", f"Routes by the number of correct rollouts ({_label(paths[0])})",
          os.path.join(out, "routes.png"), written)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.csv file(s) of scgrpo runs")
    parser.add_argument("--out", default="plots", help="folder for the PNG files")
    args = parser.parse_args()
    for path in plot(args.metrics, args.out):
        print(path)


if __name__ == "__main__":
    main()
