"""scripts/bench_table.py's summary figures: a figure kept as information has no target, and
step_over_trl_at_trl_memory is the larger of GRPO's and SC-GRPO's step over TRL's, from one call's file."""

from __future__ import annotations

import json

import pytest

from tests.helpers import load_script

table = load_script("bench_table")


def test_a_figure_kept_as_information_has_no_target_and_shows_a_dash():
    info = table.entry("grpo_over_trl_peak_mem", 2.1474, "card", "cmd", "note")
    assert info["met"] is None and info["target"] == "information" and info["value"] == 2.147
    assert table.met_cell(info) == "-"
    below = table.entry("step_over_trl_at_trl_memory", 0.15, "card", "cmd", "note")
    above = table.entry("step_over_trl_at_trl_memory", 0.1501, "card", "cmd", "note")
    assert (below["met"], above["met"]) == (True, False) and below["target"] == "<= 0.15"
    assert (table.met_cell(below), table.met_cell(above)) == ("yes", "**no**")


def test_the_step_at_trl_memory_is_the_larger_ratio_of_one_calls_cases(tmp_path, monkeypatch):
    monkeypatch.setattr(table, "RESULTS", str(tmp_path))
    assert table.at_trl_memory_entries() == {}  # (no such file: no figure)
    trl = {"case": "trl_grpo", "wall_s": 8.0, "peak_allocated_gib": 3.64, "trl_command": "python scripts/bench_trl.py"}
    ours = {"model_budget_gib": 3.64, "peak_allocated_gib": 3.1}
    cases = [trl, {"case": "smollm2_grpo_at_trl_memory", "wall_s": 0.8, **ours},
             {"case": "smollm2_scgrpo_at_trl_memory", "wall_s": 1.0, **ours}]
    (tmp_path / table.AT_TRL_FILE).write_text(json.dumps({"card": "NVIDIA H200", "command": "python scripts/bench_step.py",
                                                          "cases": cases}))
    (figure,) = table.at_trl_memory_entries().values()
    assert figure["value"] == pytest.approx(0.125) and figure["met"] is True  # SC-GRPO's 1.0 / 8.0, not GRPO's 0.1
    assert figure["command"] == "python scripts/bench_trl.py && python scripts/bench_step.py"
    assert "GRPO 0.80 s (0.100)" in figure["note"] and "SC-GRPO 1.00 s (0.125)" in figure["note"]

    cases[2]["error"] = "GPUOutOfMemory: out of GPU memory in the update phase"  # (failed cases are left out)
    (tmp_path / table.AT_TRL_FILE).write_text(json.dumps({"card": "NVIDIA H200", "command": "c", "cases": cases}))
    assert table.at_trl_memory_entries() == {}
