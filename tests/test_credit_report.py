"""scripts/credit_report.py: docs/credit.md is what the committed files give, and the page's numbers on made-up
runs are the ones worked out by hand."""

import json

import pytest

from tests.helpers import load_script

report = load_script("credit_report")


@pytest.mark.slow
def test_docs_credit_md_is_what_the_files_give():
    assert report.main(["--check"]) == 0, "run python scripts/credit_report.py"


def _run(tmp_path, method, seed, curve, auroc):
    steps = list(range(1, 13))
    run = {"task": "doors_mixed", "method": method, "seed": seed,
           "evaluations": [{"step": 25 * k, "id": {"avg@8": v}} for k, v in enumerate(curve)]
           + [{"step": 125, "ood": {"avg@8": 0.5}}],
           "steps": {"step": steps, "pivot_rows": [4.0] * 12,
                     # logged on steps 1, 6, 11; the values between them are a repeat that must not count
                     "pivot_auroc": [auroc if s % 5 == 1 else 0.0 for s in steps], "pivot_share": [2.0] * 12}}
    (tmp_path / f"{method}_{seed}.json").write_text(json.dumps(run))


def test_the_primary_outcome_and_its_tests_by_hand(tmp_path):
    # SC-GRPO's areas (mean of the evaluations after step 0) beat GRPO's by 0.1, 0.2, 0.3 over seeds 0-2
    for seed in range(3):
        _run(tmp_path, "scgrpo", seed, [0.0, 0.5 + 0.1 * (seed + 1), 0.5 + 0.1 * (seed + 1)], 0.7 + 0.1 * seed)
        for other in ("grpo", "scgrpo-permuted", "grpo-scaled"):
            _run(tmp_path, other, seed, [0.9, 0.5, 0.5], 0.5)
    page = report.report(str(tmp_path))
    assert "**Not yet run in full: 12 of 40 runs**" in page
    assert "| scgrpo | 3 | 0.700 ± 0.100 | 0.500 ± 0.000 | 0.800 ± 0.100 | 2.000 ± 0.000 | 36 |" in page
    # differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, p = 1 - 2 sqrt3 / sqrt14 = 0.0742 (t = 2 sqrt 3, df 2);
    # the three p-values tie: Holm gives 3 x 0.0742 = 0.2226 to the first and keeps the running maximum after
    # it; the Wilcoxon p of 3 positive differences is 2/8
    line = next(l for l in page.splitlines() if l.startswith("| grpo | 3 | +0.2000 |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[3] == "0.1000" and cells[6] == "0.074" and cells[7] == "0.223" and cells[8] == "0.250"
    # the first test is kept (0.074 > 0.05/3), so all three are at Holm's strictest level, 1 - 0.05/3; the
    # interval's t_{1 - 0.05/6} at df 2 in closed form: (2p - 1) / sqrt(2p(1 - p)) = 7.649
    half = 7.649 * 0.1 / 3 ** 0.5
    assert cells[5] == "0.9833" and cells[4] == f"[{0.2 - half:+.4f}, {0.2 + half:+.4f}]"
    stats = load_script("paired_stats")
    assert cells[9] == f"{stats.detectable_effect(0.1, 3, 0.05 / 3):.4f}"
    assert all(l.split("|")[6].strip() == "0.9833" for l in page.splitlines() if l.startswith("| grpo") and "+0.2000" in l)
    # SC-GRPO's AUROC 0.7, 0.8, 0.9 against 0.5: mean 0.8; minus the permuted arm's 0.5: +0.300
    assert "| SC-GRPO's AUROC (against 0.5) | 3 | 0.800 |" in page
    assert "| SC-GRPO minus permuted f | 3 | +0.300 |" in page


def test_the_reanalysis_weights_steps_by_decision_tokens_and_resamples_seeds_then_steps():
    import math
    import random

    seeds = [[(math.log(2.0), 1), (math.log(8.0), 3)]]  # (1 x log 2 + 3 x 3 log 2) / 4 = 2.5 log 2
    assert math.exp(report.weighted(seeds)) == pytest.approx(2 ** 2.5)
    low, high = report.cluster_bootstrap(seeds, random.Random(0))
    assert math.exp(low) == pytest.approx(2.0) and math.exp(high) == pytest.approx(8.0)  # one seed: its steps drawn alone, both ends reached
    same = [[(0.5, 2)], [(0.5, 7)]]  # every seed and step alike: a point interval
    assert report.cluster_bootstrap(same, random.Random(1)) == (0.5, 0.5)
    run = {"weight_shares": {"by_step": {
        "1": {"partial": {"tokens": 500, "decision_tokens": 50, "concentration": 3.0}},  # the base step: not read
        "6": {"partial": {"tokens": 99, "decision_tokens": 9, "concentration": 3.0}},  # under 100 tokens
        "11": {"partial": {"tokens": 300, "decision_tokens": 30, "concentration": 2.0}}}}}
    assert report.route_steps(run, "partial") == [(math.log(2.0), 30)]


def test_token_auroc_and_concentration_by_hand():
    import numpy as np

    # wrong f 0.9, 0.5 against right 0.5, 0.1: pairs 1 + 1 + 1/2 + 1 of 4
    F = np.array([[0.9, 0.5, 0.5, 0.1]])
    assert report.auroc_draws(F, np.array([2, 2, 1, 1]))[0] == pytest.approx(0.875)
    assert report.auroc_draws(F, np.array([2, 2, 0, 0])) is None  # no right decision
    # decisions hold f 0.8 + 0.4 = 1.2 of 2.0 on 2 of 4 tokens: (0.6) / (0.5) = 1.2
    rows = [{"f": [0.8, 0.2], "decision": [2, 0]}, {"f": [0.4, 0.6], "decision": [1, 0]}]
    value, decisions = report.step_concentration(rows)
    assert value == pytest.approx(np.log(1.2)) and decisions == 2
    f, labels, bins = report._step_arrays(rows)
    log_c, n = report.concentration_draws(f[None, :], labels)
    assert log_c[0] == pytest.approx(np.log(1.2)) and n == 2
    assert report.position_bins(2) == [0, 2] and report.position_bins(5) == [0, 0, 1, 2, 3]


def test_the_position_null_shuffles_within_positions_only():
    import numpy as np

    f = np.array([0.1, 0.2, 0.3, 0.7, 0.8, 0.9])
    bins = np.array([0, 0, 0, 2, 2, 2])
    out = report.position_permuted(f, bins, 50, np.random.default_rng(0))
    assert all(sorted(row[:3]) == [0.1, 0.2, 0.3] and sorted(row[3:]) == [0.7, 0.8, 0.9] for row in out.tolist())
    assert len({tuple(row) for row in out.tolist()}) > 1  # the draws differ


def test_a_weight_set_by_position_alone_is_the_null():
    # every wrong move is a row's second token and f is high there: AUROC 1, all of it position
    rows = [{"f": [0.2, 0.8], "decision": [1, 2]} for _ in range(4)]
    observed, null, p = report.position_null([[rows]], "auroc", __import__("numpy").random.default_rng(0))
    assert observed == 1.0 and null == 1.0 and p == 1.0


def test_a_weight_that_tells_moves_apart_at_one_position_beats_the_null():
    import numpy as np

    # one-token rows (one position): wrong moves f 0.9, right ones 0.1; a shuffle separates them 1 time in C(10,5)
    rows = [{"f": [0.9], "decision": [2]} for _ in range(5)] + [{"f": [0.1], "decision": [1]} for _ in range(5)]
    observed, null, p = report.position_null([[rows]], "auroc", np.random.default_rng(0))
    assert observed == 1.0
    assert 0.45 < null < 0.55
    assert p < 0.02


def test_the_turn_and_row_aurocs_of_the_stored_rows_by_hand():
    """One step, three two-turn rows (the right move first), as in tests/test_pivots.py: pooled 5 of 9 pairs,
    within turns 1 of 4, within rows 2 of 3; the same with each token's turn stored or read from the order of its
    row's moves (two runs of move tokens a row)."""
    stored = [{"step": 1, "f": [0.3, 0.9], "decision": [1, 2], "turn": [0, 1]},
              {"step": 1, "f": [0.2, 0.8], "decision": [1, 2], "turn": [0, 1]},
              {"step": 1, "f": [0.1, 0.85], "decision": [2, 1], "turn": [0, 1]}]
    want = {"pooled": 5 / 9, "turn": 1 / 4, "row": 2 / 3}
    got = report.run_aurocs([stored])
    assert got == pytest.approx(want)
    # older files: no turn; a separating non-move token keeps the two moves apart
    older = [{"step": 1, "f": [r["f"][0], 0.5, r["f"][1]], "decision": [r["decision"][0], 0, r["decision"][1]]}
             for r in stored]
    assert report.run_aurocs([older]) == pytest.approx(want)
    # a row whose moves touch (one run) says nothing of its turns: left out of the within-turn AUROC only
    touching = older + [{"step": 1, "f": [0.0, 0.99], "decision": [1, 2]}]
    got = report.run_aurocs([touching])
    assert got["turn"] == pytest.approx(1 / 4) and got["row"] == pytest.approx(3 / 4)


def test_the_conclusions_follow_the_tests():
    found = {"primary": [{"other": "grpo", "mean": 0.01, "low": -0.02, "high": 0.04, "holm_p": 0.4, "mde": 0.06,
                          "n": 10},
                         {"other": "grpo-scaled", "mean": 0.05, "low": 0.01, "high": 0.09, "holm_p": 0.01, "mde": 0.03,
                          "n": 10}],
             "auroc": {("turn", "scgrpo"): {"mean": 0.67, "low": 0.59, "high": 0.75},
                       ("turn", "minus permuted"): {"mean": 0.17, "low": 0.05, "high": 0.29},
                       ("row", "scgrpo"): {"mean": 0.52, "low": 0.45, "high": 0.6},
                       ("row", "minus permuted"): {"mean": 0.01, "low": -0.05, "high": 0.07}}}
    lines = report.conclusions(found)
    assert "no difference shown" in lines[0] and "0.0600 or more" in lines[0] and "could have gone unseen" in lines[0]
    assert "a difference at the family level" in lines[1]
    assert "(above 0.5)" in lines[2] and "lands differs from SC-GRPO's" in lines[2]
    assert "(not distinguished from 0.5)" in lines[3] and "is not distinguished from SC-GRPO's" in lines[3]
