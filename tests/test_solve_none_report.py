"""docs/solve_none.md and its summary are what scripts/solve_none_report.py makes of the committed result files."""

import json
import os

from tests.helpers import load_script

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _report():
    return load_script("solve_none_report")


def test_the_committed_page_and_summary_are_regenerated_byte_for_byte(tmp_path):
    report = _report()
    report.main(str(tmp_path / "page.md"), str(tmp_path / "summary.json"))
    with open(os.path.join(ROOT, "docs", "solve_none.md")) as f:
        assert (tmp_path / "page.md").read_text() == f.read()
    with open(os.path.join(ROOT, "benchmarks", "results", "solve_none", "summary.json")) as f:
        assert (tmp_path / "summary.json").read_text() == f.read()


def test_held_needs_length_and_entropy_near_their_start():
    report = _report()

    def run(length, entropy):
        return {"seed": 0, "card": "c", "wall_s": 1.0, "steps": {"completion_length": length, "entropy": entropy,
                                                                   "accuracy": [0.0] * len(length)},
                "evaluations": [{"id": {"avg@8": 0.0, "completion_length": 1.0}}]}

    steady = report.run_summary(run([70.0] + [40.0] * 150, [2.4] + [2.5] * 150))
    assert steady["held"] and steady["first_collapsed_step"] is None
    collapsed = report.run_summary(run([70.0] + [40.0] * 50 + [1.0] * 100, [2.4] * 151))
    assert not collapsed["held"] and collapsed["first_collapsed_step"] == 51 and collapsed["collapsed_steps"] == 100
    noisy = report.run_summary(run([70.0] * 151, [2.4] + [6.0] * 150))  # entropy to noise: not held
    repetitive = report.run_summary(run([70.0] * 151, [2.4] + [0.05] * 150))
    short = report.run_summary(run([70.0] + [5.0] * 150, [2.4] * 151))  # under a quarter of the start
    assert not noisy["held"] and not repetitive["held"] and not short["held"]
    assert json.dumps(steady)  # plain JSON
