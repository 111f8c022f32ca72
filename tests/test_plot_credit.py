"""scripts/plot_credit.py: the series it reads from metrics.csv and the figures it writes."""

import csv
import os

import pytest

from tests.helpers import load_script


def _script():
    return load_script("plot_credit")


def _metrics(path):
    """A Lightning-style metrics.csv: training rows with the credit keys (one NaN), a validation row without."""
    keys = ["step", "credit/kl_p25", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95", "credit/c", "policy/entropy",
            "credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all", "val/id/avg@4"]
    rows = [
        {"step": 0, "credit/kl_p25": 0.001, "credit/kl_p50": 0.01, "credit/kl_p75": 0.05, "credit/kl_p95": 0.3,
         "credit/c": 0.05, "policy/entropy": 0.9, "credit/route_partial": 0.5, "credit/route_solve_none": 0.25,
         "credit/route_single": 0.25, "credit/route_all": 0.0},
        {"step": 1, "credit/kl_p25": "nan", "credit/kl_p50": 0.02, "credit/kl_p75": 0.06, "credit/kl_p95": 0.4,
         "credit/c": 0.06, "policy/entropy": 0.8, "credit/route_partial": 0.75, "credit/route_solve_none": 0.0,
         "credit/route_single": 0.25, "credit/route_all": 0.0},
        {"step": 1, "val/id/avg@4": 0.3},
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def test_series_skip_missing_and_non_finite_values(tmp_path):
    path = tmp_path / "metrics.csv"
    _metrics(path)
    series = _script().read_series(str(path), ("credit/kl_p25", "credit/kl_p75", "policy/entropy"))
    assert series["credit/kl_p25"] == ([0], [0.001])  # the NaN at step 1 is left out
    assert series["credit/kl_p75"] == ([0, 1], [0.05, 0.06])
    assert series["policy/entropy"] == ([0, 1], [0.9, 0.8])  # the validation row has none


def test_the_figures_are_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run" / "version_0" / "metrics.csv"
    path.parent.mkdir(parents=True)
    _metrics(path)
    written = _script().plot([str(path), str(path)], str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in written] == ["kl_percentiles.png", "entropy.png", "routes.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 5000
