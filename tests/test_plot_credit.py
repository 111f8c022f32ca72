"""scripts/plot_credit.py: the series it reads from metrics.csv and the figures it writes."""

import csv
import os
import sys

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


def _grpo_metrics(path):
    """A GRPO run's metrics.csv: entropy and reward every step, no credit/* key at all."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "train/reward", "policy/entropy", "val/id/avg@4"])
        writer.writeheader()
        writer.writerows([{"step": 0, "train/reward": 0.5, "policy/entropy": 0.9},
                          {"step": 1, "train/reward": 0.6, "policy/entropy": 0.8}, {"step": 1, "val/id/avg@4": 0.3}])


def test_a_grpo_run_gets_no_empty_credit_figures_and_is_told_why(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    grpo = tmp_path / "grpo" / "version_0" / "metrics.csv"
    grpo.parent.mkdir(parents=True)
    _grpo_metrics(grpo)
    _script().main([str(grpo), "--out", str(tmp_path / "plots")])
    assert os.listdir(tmp_path / "plots") == ["entropy.png"]
    err = capsys.readouterr().err
    assert f"kl_percentiles.png not written: no credit/kl_p* or credit/c values in {grpo}" in err
    assert f"routes.png not written: no credit/route_* values in {grpo}" in err and "GRPO does not" in err

    scgrpo = tmp_path / "scgrpo" / "version_0" / "metrics.csv"  # beside an SC-GRPO run: its credit alone is drawn
    scgrpo.parent.mkdir(parents=True)
    _metrics(scgrpo)
    _script().main([str(grpo), str(scgrpo), "--out", str(tmp_path / "both")])
    assert sorted(os.listdir(tmp_path / "both")) == ["entropy.png", "kl_percentiles.png", "routes.png"]
    assert f"{grpo} left out of kl_percentiles.png: no credit/kl_p* or credit/c values" in capsys.readouterr().err


def test_nothing_to_plot_writes_nothing_and_exits_non_zero(tmp_path, capsys):
    path = tmp_path / "metrics.csv"
    path.write_text("step,val/id/avg@4\n0,0.3\n")
    with pytest.raises(SystemExit) as info:
        _script().main([str(path), "--out", str(tmp_path / "plots")])
    assert info.value.code == f"plot_credit.py: error: nothing to plot in {path}"
    assert not os.path.exists(tmp_path / "plots")
    assert "entropy.png not written: no policy/entropy values" in capsys.readouterr().err


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    _metrics(path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as info:
        _script().main([str(path), "--out", str(tmp_path / "plots")])
    assert info.value.code == ("plot_credit.py: error: matplotlib is not installed: pip install -e '.[plots]' (or pip "
                               "install matplotlib)")
    assert not os.path.exists(tmp_path / "plots")


def _three_steps(path):
    """A 3-step SC-GRPO run whose c is its P75, as SCGRPO's default c_quantile gives."""
    keys = ["step", "credit/kl_p25", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95", "credit/c", "policy/entropy",
            "credit/route_partial"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for step, p75 in enumerate((0.05, 0.06, 0.07)):
            writer.writerow({"step": step, "credit/kl_p25": 0.001, "credit/kl_p50": 0.01, "credit/kl_p75": p75,
                             "credit/kl_p95": 0.3, "credit/c": p75, "policy/entropy": 0.9, "credit/route_partial": 0.5})


def test_a_short_run_is_ticked_in_whole_steps_on_every_figure(tmp_path, figures):
    from matplotlib.ticker import MaxNLocator

    path = tmp_path / "metrics.csv"
    _three_steps(path)
    drawn = figures(_script().plot([str(path)], str(tmp_path / "plots")))
    assert sorted(drawn) == ["entropy.png", "kl_percentiles.png", "routes.png"]
    for name, fig in drawn.items():
        (ax,) = fig.axes
        assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator), name
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks == [0, 1, 2], (name, ticks)  # (matplotlib's default puts ticks at 0.25, 0.5, ...)


def test_c_on_its_p75_leaves_both_lines_in_sight(tmp_path, figures):
    path = tmp_path / "metrics.csv"
    _three_steps(path)
    (ax,) = figures(_script().plot([str(path)], str(tmp_path / "plots")))["kl_percentiles.png"].axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    p75, c = lines["kl_p75"], lines["c"]
    assert list(p75.get_ydata()) == list(c.get_ydata()) == [0.05, 0.06, 0.07]  # the same values...
    assert (p75.get_linestyle(), p75.get_marker()) != (c.get_linestyle(), c.get_marker())  # ...told apart
    assert p75.get_color() != c.get_color() and c.get_marker() not in (None, "None", "")
    assert p75.get_linewidth() > c.get_linewidth()  # the wide P75 shows round the thin c
    assert ax.get_lines().index(c) > ax.get_lines().index(p75)  # drawn on top of it
