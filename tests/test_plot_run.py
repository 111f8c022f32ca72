"""scripts/plot_run.py: the series it reads from a run's metrics.csv and the figures it draws of them."""

import csv
import os
import sys

import pytest

from tests.helpers import load_script

# Lightning's CSVLogger: the keys sorted, a row per logging call, empty cells for the keys a row does not have
COLUMNS = ["credit/c", "epoch", "policy/entropy", "step", "train/completion_length", "train/loss", "train/reward",
           "train/reward_std", "val/global_step", "val/id/avg@4", "val/id/completion_length", "val/id/greedy",
           "val/id/pass@4", "val/ood/avg@4", "val/ood/completion_length", "val/ood/greedy", "val/ood/pass@4"]
REWARD = [0.25, 0.5, 0.375, 0.75]
REWARD_STD = [0.125, 0.25, 0.25, 0.125]
LENGTH = [30.0, 28.0, 25.0, 21.0]
ENTROPY = [1.25, "nan", 1.0, 0.875]  # (NaN where the engine gives no entropy)


def _script():
    return load_script("plot_run")


def _validation(step, avg_id, avg_ood):
    return {"step": step, "val/global_step": float(step), "val/id/avg@4": avg_id, "val/id/completion_length": 20.0,
            "val/id/greedy": 0.0, "val/id/pass@4": 0.75, "val/ood/avg@4": avg_ood,
            "val/ood/completion_length": 24.0, "val/ood/greedy": 0.0, "val/ood/pass@4": 0.5}


def _metrics(path, validation=True):
    """4 training steps (0..3) and, with ``validation``, an evaluation of both splits before the first step and
    after the last, as a run with validate_before_training and val_check_interval 4 logs them."""
    rows = [_validation(0, 0.125, 0.0)] if validation else []
    for step in range(4):
        rows.append({"credit/c": 0.05, "epoch": 0, "policy/entropy": ENTROPY[step], "step": step,
                     "train/completion_length": LENGTH[step], "train/loss": 0.1, "train/reward": REWARD[step],
                     "train/reward_std": REWARD_STD[step]})
    if validation:
        rows.append(_validation(4, 0.5, 0.25))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS if validation else COLUMNS[:8])
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def _run(tmp_path, name="scgrpo", validation=True):
    """A run folder ``runs/<name>/version_0`` holding its metrics.csv."""
    folder = tmp_path / "runs" / name / "version_0"
    _metrics(folder / "metrics.csv", validation)
    return str(folder)


def _lines(fig):
    (ax,) = fig.axes
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_the_series_of_a_run(tmp_path):
    path = _metrics(tmp_path / "metrics.csv")
    script = _script()
    assert script.accuracy_keys(script.columns_of(path)) == {"id": "val/id/avg@4", "ood": "val/ood/avg@4"}
    assert script.length_keys(script.columns_of(path)) == {"id": "val/id/completion_length",
                                                           "ood": "val/ood/completion_length"}
    series = script.read_run(path)
    assert series["train/reward"] == ([0, 1, 2, 3], REWARD)  # (the validation rows have none)
    assert series["train/reward_std"] == ([0, 1, 2, 3], REWARD_STD)
    assert series["train/completion_length"] == ([0, 1, 2, 3], LENGTH)
    assert series["policy/entropy"] == ([0, 2, 3], [1.25, 1.0, 0.875])  # the NaN left out
    assert series["val/id/avg@4"] == ([0, 4], [0.125, 0.5]) and series["val/ood/avg@4"] == ([0, 4], [0.0, 0.25])
    assert series["val/ood/completion_length"] == ([0, 4], [24.0, 24.0])
    assert "val/id/pass@4" not in series and "val/id/greedy" not in series


def test_a_split_logged_as_accuracy_is_read_where_it_has_no_avg_at_k():
    keys = _script().accuracy_keys(["step", "val/a/accuracy", "val/b/accuracy", "val/b/avg@8", "val/b/pass@8",
                                    "train/accuracy", "test/c/avg@8"])
    assert keys == {"a": "val/a/accuracy", "b": "val/b/avg@8"}


def test_a_run_folder_gets_its_four_figures_in_its_plots_folder(tmp_path, figures, capsys):
    from matplotlib.collections import PolyCollection
    from matplotlib.ticker import MaxNLocator

    run = _run(tmp_path)
    _script().main([run])
    written = capsys.readouterr().out.split()  # (the files written, a line each)
    assert [os.path.relpath(p, run) for p in written] == [os.path.join("plots", name) for name in (
        "reward.png", "accuracy.png", "completion_length.png", "entropy.png")]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 5000
    drawn = figures(written)

    assert _lines(drawn["reward.png"]) == {"train/reward": ([0, 1, 2, 3], REWARD)}
    (band,) = [c for c in drawn["reward.png"].axes[0].collections if isinstance(c, PolyCollection)]
    assert band.get_label() == "± train/reward_std"
    y = band.get_paths()[0].vertices[:, 1]
    assert min(y) == pytest.approx(0.125) and max(y) == pytest.approx(0.875)  # 0.25 - 0.125 .. 0.75 + 0.125

    assert _lines(drawn["accuracy.png"]) == {"id avg@4": ([0, 4], [0.125, 0.5]), "ood avg@4": ([0, 4], [0.0, 0.25])}
    assert _lines(drawn["completion_length.png"]) == {
        "train": ([0, 1, 2, 3], LENGTH), "val id": ([0, 4], [20.0, 20.0]), "val ood": ([0, 4], [24.0, 24.0])}
    assert _lines(drawn["entropy.png"]) == {"policy/entropy": ([0, 2, 3], [1.25, 1.0, 0.875])}

    for name, fig in drawn.items():
        (ax,) = fig.axes
        assert ax.get_xlabel() == "step" and ax.get_ylabel() and "scgrpo/version_0" in ax.get_title(), name
        assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator), name
        assert all(t == int(t) for t in ax.get_xticks()), (name, ax.get_xticks())
        if name != "reward.png":  # (one series, one line: the legend has the band too)
            assert len(ax.get_lines()) == len(ax.get_legend().get_texts()), name
    # a split's lines are told apart by more than their colour: where two splits have the same values both show
    id_line, ood_line = drawn["accuracy.png"].axes[0].get_lines()
    assert (id_line.get_linestyle(), id_line.get_marker()) != (ood_line.get_linestyle(), ood_line.get_marker())


def test_several_runs_on_the_same_axes_labelled_by_folder(tmp_path, figures, capsys):
    scgrpo, grpo = _run(tmp_path, "scgrpo"), _run(tmp_path, "grpo", validation=False)
    out = tmp_path / "plots"
    written = _script().plot([os.path.join(scgrpo, "metrics.csv"), os.path.join(grpo, "metrics.csv")], str(out))
    drawn = figures(written)
    assert sorted(os.listdir(out)) == ["accuracy.png", "completion_length.png", "entropy.png", "reward.png"]
    assert _lines(drawn["reward.png"]) == {"scgrpo/version_0": ([0, 1, 2, 3], REWARD),
                                           "grpo/version_0": ([0, 1, 2, 3], REWARD)}
    assert set(_lines(drawn["entropy.png"])) == {"scgrpo/version_0", "grpo/version_0"}
    assert set(_lines(drawn["accuracy.png"])) == {"id avg@4 (scgrpo/version_0)", "ood avg@4 (scgrpo/version_0)"}
    assert set(_lines(drawn["completion_length.png"])) == {
        "train (scgrpo/version_0)", "val id (scgrpo/version_0)", "val ood (scgrpo/version_0)",
        "train (grpo/version_0)"}
    reward = drawn["reward.png"].axes[0].get_lines()
    assert reward[0].get_color() != reward[1].get_color()
    assert f"{os.path.join(grpo, 'metrics.csv')} left out of accuracy.png: no val/<split>/avg@k values" in \
        capsys.readouterr().err


def test_several_runs_need_an_out_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _script().main([_run(tmp_path, "a"), _run(tmp_path, "b")])
    assert info.value.code == 2 and "--out is needed with several runs" in capsys.readouterr().err


def test_a_metrics_file_is_a_run_too_and_a_figure_without_values_is_not_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = os.path.join(_run(tmp_path, validation=False), "metrics.csv")
    _script().main([path])
    assert sorted(os.listdir(os.path.join(os.path.dirname(path), "plots"))) == [
        "completion_length.png", "entropy.png", "reward.png"]
    assert f"plot_run.py: accuracy.png not written: no val/<split>/avg@k values in {path}" in capsys.readouterr().err


def test_nothing_to_plot_writes_nothing_and_exits_non_zero(tmp_path, capsys):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss\n0,0,0.5\n0,1,0.4\n")
    with pytest.raises(SystemExit) as info:
        _script().main([str(path), "--out", str(tmp_path / "plots")])
    assert info.value.code == f"plot_run.py: error: nothing to plot in {path}"  # (exit status 1)
    assert not os.path.exists(tmp_path / "plots")
    err = capsys.readouterr().err
    for name in ("reward.png", "accuracy.png", "completion_length.png", "entropy.png"):
        assert f"plot_run.py: {name} not written" in err


def test_a_run_without_metrics_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _script().main([str(tmp_path)])
    assert info.value.code == 2
    assert f"{tmp_path} is not a metrics.csv file or a run folder that holds one" in capsys.readouterr().err


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, monkeypatch):
    run = _run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as info:
        _script().main([run])
    assert info.value.code == ("plot_run.py: error: matplotlib is not installed: pip install -e '.[plots]' (or pip "
                               "install matplotlib)")
    assert not os.path.exists(os.path.join(run, "plots"))
