"""Plots of a run's self-teacher signal over training steps, from its ``metrics.csv``.

    python scripts/plot_credit.py runs/scgrpo_arith/version_0/metrics.csv --out plots/

Writes ``kl_percentiles.png`` (credit/kl_p25, p50, p75, p95 and c, log scale; c, by default the P75 of the same
divergences, is drawn thin, dashed and marked in black over a wide P75 line, so both show where they meet),
``entropy.png`` (policy/entropy, the mean token entropy of the sampled responses) and ``routes.png`` (the share of
groups in each route, from the first run that logs them). Several CSV files (seeds, or methods) are drawn on the same
axes, labelled by their folder. Steps are ticked in whole numbers.

The credit/* keys are logged by objectives with a self-teacher (SC-GRPO); a GRPO run has policy/entropy only. A
figure with nothing to draw is not written, and a run without credit values beside runs with them is left out of
those figures; both are said on stderr. With nothing to draw at all the script ends with status 1. It needs
matplotlib: ``pip install -e '.[plots]'``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

PERCENTILES = ("credit/kl_p25", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95")
ROUTES = ("credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all")
KL_STYLES = {  # c (by default the P75 of the same divergences) thin, dashed and marked, over a wide P75 line
    "credit/kl_p25": dict(linestyle=":", color="C0", linewidth=1),
    "credit/kl_p50": dict(linestyle="--", color="C1", linewidth=1),
    "credit/kl_p75": dict(linestyle="-", color="C2", linewidth=3),
    "credit/kl_p95": dict(linestyle="-.", color="C3", linewidth=1),
    "credit/c": dict(linestyle="--", color="black", linewidth=1, marker="o", markersize=3),
}
FIGURES = {  # each figure: the keys it draws, and in words
    "kl_percentiles.png": (PERCENTILES + ("credit/c",), "credit/kl_p* or credit/c"),
    "entropy.png": (("policy/entropy",), "policy/entropy"),
    "routes.png": (ROUTES, "credit/route_*"),
}


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


def _note(message: str) -> None:
    print(f"plot_credit.py: {message}", file=sys.stderr)


def pyplot(script: str = "plot_credit.py"):
    """matplotlib's pyplot on the Agg backend; without matplotlib the script (named ``script`` in the message) ends
    in one line that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{script}: error: matplotlib is not installed: pip install -e '.[plots]' (or pip "
                         "install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has(series: dict, keys: tuple[str, ...]) -> bool:
    return any(series[key][0] for key in keys)


def _save(plt, fig, ax, ylabel: str, title: str, path: str, written: list[str]) -> None:
    """Labels ``ax`` (steps are whole numbers: integer ticks, never 0.5 in a short run; values in full, not as an
    offset such as 1e-5+5.5495 where they hardly move), writes ``fig`` to ``path`` and closes it."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if isinstance(ax.yaxis.get_major_formatter(), ScalarFormatter):  # (not on a log scale)
        ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)


def plot(paths: list[str], out: str) -> list[str]:
    """Draws the figures that have something to draw for ``paths`` into the folder ``out``; returns the files
    written. A figure left out, and a run left out of figures that others are in, are said on stderr."""
    runs = {p: read_series(p, tuple(key for keys, _ in FIGURES.values() for key in keys)) for p in paths}
    drawn = {name: [p for p, series in runs.items() if _has(series, keys)] for name, (keys, _) in FIGURES.items()}
    for name, (keys, what) in FIGURES.items():
        why = " (objectives with a self-teacher, such as SCGRPO, log them; GRPO does not)" if "credit/" in what else ""
        if not drawn[name]:
            _note(f"{name} not written: no {what} values in {', '.join(paths)}{why}")
        elif len(drawn[name]) < len(paths) and name != "routes.png":  # (routes.png draws one run)
            left_out = [p for p in paths if p not in drawn[name]]
            _note(f"{', '.join(left_out)} left out of {name}: no {what} values{why}")
    if not any(drawn.values()):
        return []
    plt = pyplot()
    os.makedirs(out, exist_ok=True)
    written: list[str] = []

    if drawn["kl_percentiles.png"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, path in enumerate(drawn["kl_percentiles.png"]):
            for key in FIGURES["kl_percentiles.png"][0]:  # (c last: on top of P75, which it is by default)
                steps, values = runs[path][key]
                if steps:
                    label = key.split("/")[-1] + (f" ({_label(path)})" if len(runs) > 1 else "")
                    ax.plot(steps, values, **KL_STYLES[key], alpha=1.0 if i == 0 else 0.6, label=label,
                            markevery=max(1, len(steps) // 20))
        ax.set_yscale("log")
        _save(plt, fig, ax, "KL(teacher || policy) per token", "Self-teacher divergence of active tokens, and c",
              os.path.join(out, "kl_percentiles.png"), written)

    if drawn["entropy.png"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for path in drawn["entropy.png"]:
            steps, values = runs[path]["policy/entropy"]
            ax.plot(steps, values, label=_label(path))
        _save(plt, fig, ax, "nats per token", "Policy entropy of the sampled responses",
              os.path.join(out, "entropy.png"), written)

    if drawn["routes.png"]:
        first = drawn["routes.png"][0]
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in ROUTES:
            steps, values = runs[first][key]
            if steps:
                ax.plot(steps, values, label=key.split("route_")[-1])
        ax.set_ylim(0, 1)
        _save(plt, fig, ax, "share of groups", f"Routes by the number of correct rollouts ({_label(first)})",
              os.path.join(out, "routes.png"), written)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.csv file(s) of scgrpo runs")
    parser.add_argument("--out", default="plots", help="folder for the PNG files")
    args = parser.parse_args(argv)
    for path in args.metrics:
        if not os.path.isfile(path):
            parser.error(f"{path} is not a file")
    written = plot(args.metrics, args.out)
    if not written:
        raise SystemExit(f"plot_credit.py: error: nothing to plot in {', '.join(args.metrics)}")
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
