"""scripts/replication_report.py: the committed page is what the committed result files give, and its numbers
(means, spreads, paired differences, verdicts) are the ones worked out by hand on small made-up runs."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("replication_report",
                                                  os.path.join(ROOT, "scripts", "replication_report.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["replication_report"] = module
    spec.loader.exec_module(module)
    return module


rep = _load()


def test_the_committed_page_and_summary_are_regenerated_byte_for_byte(tmp_path):
    results = os.path.join(ROOT, "benchmarks", "results", "replication")
    copy = tmp_path / "results"
    copy.mkdir()
    for name in os.listdir(results):
        if name.endswith(".json") and name != "summary.json":
            (copy / name).write_bytes(open(os.path.join(results, name), "rb").read())
    page, summary, _ = rep.report(str(copy))
    with open(os.path.join(ROOT, "docs", "replication.md")) as f:
        assert page == f.read()
    with open(os.path.join(results, "summary.json")) as f:
        assert json.loads(json.dumps(summary)) == json.load(f)
    for method in ("grpo", "dapo", "scgrpo", "scgrpo-buffer", "selfdistill-fkl", "opsd-oracle"):
        block = summary["methods"][method]
        assert set(block) == {"id_avg8", "id_pass8", "ood_avg8", "ood_pass8"}
        assert len(block["id_avg8"]["seeds"]) == 3 and set(block["id_avg8"]) == {"mean", "std", "seeds"}
    assert summary["card"] and summary["command"].startswith("python scripts/replicate.py")


def _run(method, seed, finals, steps=4, rollouts=None, reward=None, task="arith", lr=2e-4):
    """A made-up result file: evaluations at 0 and at ``steps`` (finals: (id avg, id pass, ood avg, ood pass))."""
    ia, ip, oa, op = finals
    last = {"id": {"avg@8": ia, "pass@8": ip, "greedy": ia, "completion_length": 10.0},
            "ood": {"avg@8": oa, "pass@8": op, "greedy": oa, "completion_length": 10.0}}
    first = {"id": {"avg@8": 0.01, "pass@8": 0.05, "greedy": 0.0, "completion_length": 30.0},
             "ood": {"avg@8": 0.0, "pass@8": 0.0, "greedy": 0.0, "completion_length": 30.0}}
    series = {k: [0.1] * steps for k in ("entropy", "kl_p25", "kl_p50", "kl_p75", "kl_p95", "route_partial",
                                         "route_solve_none", "route_single", "route_all", "step_s", "generation_s",
                                         "teacher_s", "train_s")}
    series["reward"] = reward or [0.5] * steps
    series["step"] = list(range(1, steps + 1))
    return {"name": f"{task}_{method}_lr2e-4_seed{seed}", "task": task, "method": method, "seed": seed, "lr": lr,
            "card": "TEST", "gpus": 1, "runs_per_gpu": 1, "versions": {"torch": "x"}, "segments": 1,
            "rollouts": rollouts or steps * 128, "evaluations": [{"step": 0, **first}, {"step": steps, **last}],
            "steps": series}


def test_numbers_on_made_up_runs_match_hand_computation(tmp_path):
    runs = [
        _run("grpo", 0, (0.40, 0.50, 0.10, 0.20)), _run("grpo", 1, (0.50, 0.60, 0.20, 0.30)),
        _run("scgrpo", 0, (0.45, 0.50, 0.10, 0.25)), _run("scgrpo", 1, (0.60, 0.70, 0.10, 0.30)),
        _run("dapo", 0, (0.70, 0.80, 0.30, 0.40), rollouts=2048), _run("dapo", 1, (0.80, 0.90, 0.20, 0.30), rollouts=1024),
    ]
    runs[3]["evaluations"][-1]["step"] = 3  # a run whose last evaluation is not at the last step
    for run in runs:
        (tmp_path / f"{run['name']}.json").write_text(json.dumps(run))
    page, summary, groups = rep.report(str(tmp_path))
    # grpo ID Avg@8: mean 0.45, sample std of (0.40, 0.50) = 0.0707
    assert summary["methods"]["grpo"]["id_avg8"] == {"mean": 0.45, "std": 0.0707, "seeds": [0.4, 0.5]}
    assert "| grpo | 2 | 0.450 ± 0.071 | 0.550 ± 0.071 | 0.150 ± 0.071 | 0.250 ± 0.071 |" in page
    # paired SC-GRPO - GRPO, ID Avg@8: +0.05 (seed 0), +0.10 (seed 1): mean +0.075, sd 0.0354, half-width of the 95%
    # t-interval 12.706 * 0.0354 / sqrt(2) = 0.318 > 0.075: within noise
    assert ("| SC-GRPO − GRPO | ID avg@8 | +0.050 (seed 0), +0.100 (seed 1) | +0.075 | [-0.243, +0.393] | "
            "within seed noise |") in page
    assert "| dapo | 2 |" in page and "1,536 |" in page  # mean rollouts drawn (2048 + 1024) / 2
    assert "| scgrpo | 1 | 3 * |" in page and "`arith_scgrpo_lr2e-4_seed1` (step 3; one segment)" in page
    assert summary["card"] == "TEST"
    pytest.importorskip("matplotlib")
    written = rep.figures(groups, str(tmp_path / "figures"))
    assert sorted(os.path.basename(p) for p in written) == ["avg8_id.png", "avg8_ood.png", "entropy.png",
                                                            "kl_percentiles.png", "routes.png"]
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in written)


def test_verdicts_use_the_t_interval_over_seeds():
    assert rep.verdict([0.1]) == "one seed: no verdict"
    assert rep.verdict([0.1, 0.1, 0.1]) == "higher"  # no spread
    assert rep.verdict([-0.069, -0.043, -0.087]) == "lower"  # mean -0.066, sd 0.022: t = 5.2 > 4.303
    assert rep.verdict([0.01, 0.05, -0.01]) == "within seed noise"  # mean 0.017, sd 0.031: t = 0.93
    # t exactly at the edge: 3 seeds, mean m, sd s with m = 4.303 * s / sqrt(3) is not excluded
    s = 0.03
    m = 4.303 * s / 3 ** 0.5
    edge = [m - s, m, m + s]  # sd of this triple is s
    assert rep.verdict(edge) == "within seed noise" and rep.verdict([x + 1e-3 for x in edge]) == "higher"


def test_paired_differences_match_by_seed_and_first_difference():
    a = [_run("scgrpo", 0, (0.5, 0.5, 0.1, 0.1)), _run("scgrpo", 2, (0.7, 0.5, 0.1, 0.1))]
    b = [_run("grpo", 2, (0.6, 0.5, 0.1, 0.1)), _run("grpo", 1, (0.1, 0.5, 0.1, 0.1))]
    assert rep.paired(a, b, "id", "avg@8") == [(2, pytest.approx(0.1))]  # seed 0 and 1 have no partner
    x, y = _run("scgrpo", 0, (0, 0, 0, 0), reward=[0.1, 0.2, 0.3, 0.4]), _run("grpo", 0, (0, 0, 0, 0),
                                                                              reward=[0.1, 0.2, 0.5, 0.4])
    assert rep.first_difference(x, y) == 3
