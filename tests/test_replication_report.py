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


# ------------------------------------------------------------------------------------------- second round
LCM_CONFIG = """
trainer: {max_steps: 30, val_check_interval: 15}
model:
  generation: {num_generations: 8, max_new_tokens: 256, temperature: 1.0}
  optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 2.0e-4}}
  eval_samples: 8
data:
  source:
    class_path: scgrpo.data.ReasoningGymTask
    init_args: {task: lcm, config: {max_value: 100}, ood_config: {max_value: 1000}, num_eval: 32}
  batch_size: 16
"""
BLACKJACK_CONFIG = """
trainer: {max_steps: 30, val_check_interval: 15}
model:
  episodes: {max_turns: 4, max_episode_tokens: 128}
  generation: {num_generations: 8, max_new_tokens: 16, temperature: 1.0}
  optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 1.0e-4}}
  eval_samples: 8
data:
  source:
    class_path: scgrpo.data.BlackjackTask
    init_args: {num_eval: 64, num_ood: 64}
  batch_size: 16
"""


def _shares(concentration, token_share=0.2):
    """A weight-shares summary with a given concentration: the f share is concentration x the token share."""
    return {"tokens": 100, "decision_tokens": int(100 * token_share), "decision_token_share": token_share,
            "decision_f_share": concentration * token_share, "concentration": concentration,
            "mean_f_decision": concentration * 0.5, "mean_f_other": 0.5}


def _run2(task, method, seed, finals, lr=2e-4, length=20.0, entropy=(1.0, 0.5), concentration=None, wall=100.0):
    """A made-up second-round result file: 30 steps; the completion length is 100 over the first 10 steps and
    ``length`` over the last 20; the entropy is entropy[0] at the first step and entropy[1] after."""
    ia, ip, oa, op = finals
    run = _run(method, seed, (ia, ip, oa, op), steps=30, task=task, lr=lr)
    run["name"] = f"{task}_{method}_lr{lr:.0e}_seed{seed}".replace("e-0", "e-")
    run["evaluations"][0]["id"]["avg@8"] = 0.01 * (seed + 1)
    run["steps"]["completion_length"] = [100.0] * 10 + [length] * 20
    run["steps"]["entropy"] = [entropy[0]] + [entropy[1]] * 29
    run["wall_s"] = wall
    run["commands"] = [f"python scripts/replicate.py --plan main,extra --tasks {task}"]
    run["steps"]["f_mean"] = [0.3] * 30
    if method not in ("scgrpo", "scgrpo-kl-anchor"):
        for key in ("f_mean", "kl_p25", "kl_p50", "kl_p75", "kl_p95", "route_partial", "route_solve_none",
                    "route_single", "route_all"):
            run["steps"][key] = [None] * 30
    if concentration is not None:
        run["weight_shares"] = {
            "rule": "words", "names": ["hit", "stick"],
            "overall": {"pooled": _shares(concentration), "partial": _shares(2 * concentration),
                        "solve_none": _shares(1.0)},
            "by_step": {"15": {"pooled": _shares(concentration - 0.1)}, "30": {"pooled": _shares(concentration + 0.1)}}}
    return run


def _second_round(tmp_path, monkeypatch):
    """Made-up files: the first round (arith: GRPO and SC-GRPO, 2 seeds) and two second-round tasks.

    lcm: GRPO, DAPO, REINFORCE++ and SC-GRPO on seeds 0-2, the anchor on seeds 0-1 (seed 2 missing).
      ID Avg@8  GRPO 0.30 0.40 0.50; SC-GRPO 0.40 0.51 0.59; DAPO 0.45 0.40 0.70; REINFORCE++ 0.20 0.20 0.20
      OOD Avg@8 GRPO 0.10 0.20 0.30; SC-GRPO 0.20 0.29 0.41; DAPO 0.20 0.20 0.40; REINFORCE++ 0.10 0.10 0.10
      Pass@8 = Avg@8 + 0.2 everywhere; the anchor's finals are SC-GRPO's.
    blackjack (config lr 1e-4): GRPO and SC-GRPO, seeds 0-2; ID Avg@8 GRPO 0.30 0.40 0.50, SC-GRPO 0.35 0.35 0.60;
      one GRPO run at another rate, left out.
    """
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "lcm.yaml").write_text(LCM_CONFIG)
    (configs / "blackjack.yaml").write_text(BLACKJACK_CONFIG)
    monkeypatch.setattr(rep, "CONFIGS", str(configs))

    def f(ia, oa):
        return ia, ia + 0.2, oa, oa + 0.2

    runs = [_run("grpo", 0, (0.40, 0.50, 0.10, 0.20)), _run("grpo", 1, (0.50, 0.60, 0.20, 0.30)),
            _run("scgrpo", 0, (0.45, 0.50, 0.10, 0.25)), _run("scgrpo", 1, (0.60, 0.70, 0.10, 0.30))]
    for seed, (g, s, d, r) in enumerate([((0.30, 0.10), (0.40, 0.20), (0.45, 0.20), (0.20, 0.10)),
                                         ((0.40, 0.20), (0.51, 0.29), (0.40, 0.20), (0.20, 0.10)),
                                         ((0.50, 0.30), (0.59, 0.41), (0.70, 0.40), (0.20, 0.10))]):
        runs += [_run2("lcm", "grpo", seed, f(*g), length=10.0 * (seed + 1), wall=100.0 + 10 * seed),
                 _run2("lcm", "dapo", seed, f(*d)), _run2("lcm", "reinforce-pp", seed, f(*r)),
                 _run2("lcm", "scgrpo", seed, f(*s), concentration=[1.5, 1.2, 1.8][seed])]
        if seed < 2:
            runs.append(_run2("lcm", "scgrpo-kl-anchor", seed, f(*s), length=40.0, concentration=[0.8, 1.1][seed]))
    for seed, (g, s) in enumerate([(0.30, 0.35), (0.40, 0.35), (0.50, 0.60)]):
        runs += [_run2("blackjack", "grpo", seed, f(g, g), lr=1e-4),
                 _run2("blackjack", "scgrpo", seed, f(s, s), lr=1e-4, concentration=[0.5, 0.8, 0.9][seed])]
    runs.append(_run2("blackjack", "grpo", 0, f(0.9, 0.9), lr=2e-4))  # another rate: not the second round's
    for run in runs:
        (tmp_path / f"{run['name']}.json").write_text(json.dumps(run))
    return rep.report(str(tmp_path))


def test_second_round_tables_match_hand_computation(tmp_path, monkeypatch):
    page, _, _ = _second_round(tmp_path, monkeypatch)
    section = page[page.index("## Second round: tasks where credit matters"):]
    assert page.index("## What the numbers support") < page.index("## Second round")
    assert "without an evaluation after the last step" not in page  # the 30-step runs are not the first round's
    lcm = section[section.index("### lcm"):section.index("### blackjack")]
    # GRPO on lcm: ID Avg@8 0.30 0.40 0.50 -> 0.400 ± 0.100; completion length (median of the last 20 steps)
    # 10 20 30 -> 20.0 ± 10.0; 30 steps x 128 rollouts; wall 100 110 120 -> 110 ± 10
    assert ("| grpo | 3 | 0.400 ± 0.100 | 0.600 ± 0.100 | 0.200 ± 0.100 | 0.400 ± 0.100 | 0.400 ± 0.100 | "
            "20.0 ± 10.0 | 30/30/30 of 30 | 3,840 | 110 ± 10 |") in lcm
    # SC-GRPO ID Avg@8 0.40 0.51 0.59: mean 0.500, sd sqrt((0.01 + 0.0001 + 0.0081) / 2) = 0.095
    assert "| scgrpo | 3 | 0.500 ± 0.095 |" in lcm and "| scgrpo-kl-anchor | 2 | 0.455 ± 0.078 |" in lcm
    # before training: ID Avg@8 0.01 (seed + 1) over the 14 runs (5 of seed 0, 5 of seed 1, 4 of seed 2): 0.27 / 14
    assert "| before training (14 runs) | - | 0.019 | 0.050 | 0.000 | 0.000 | 0.000 | - | - | - |" in lcm
    # SC-GRPO - GRPO, ID Avg@8: +0.10 +0.11 +0.09, sd 0.01: half-width 4.303 x 0.01 / sqrt(3) = 0.0248
    assert ("| SC-GRPO − GRPO | ID avg@8 | +0.100 (seed 0), +0.110 (seed 1), +0.090 (seed 2) | +0.100 | "
            "[+0.075, +0.125] | higher |") in lcm
    # SC-GRPO - DAPO, OOD Avg@8: 0.00 +0.09 +0.01: mean 0.033, sd 0.0493, half-width 0.1226
    assert ("| SC-GRPO − DAPO | OOD avg@8 | +0.000 (seed 0), +0.090 (seed 1), +0.010 (seed 2) | +0.033 | "
            "[-0.089, +0.156] | within seed noise |") in lcm
    assert "| SC-GRPO − REINFORCE++ | ID avg@8 | +0.200 (seed 0), +0.310 (seed 1), +0.390 (seed 2) | +0.300 |" in lcm
    assert ("| SC-GRPO + anchor − SC-GRPO | ID avg@8 | +0.000 (seed 0), +0.000 (seed 1) | +0.000 | [+0.000, +0.000] | "
            "within seed noise |") in lcm
    # routes and KL of the teacher methods (0.1 at every step), f mean 0.3; entropy 1.0 at the first step, 0.5 after
    assert "| scgrpo | 0.10 | 0.10 | 0.10 | 0.10 | 0.100 | 0.100 | 0.300 | 1.000 | 0.500 |" in lcm
    assert "| grpo | - | - | - | - | - | - | - | 1.000 | 0.500 |" in lcm
    # weight shares: concentration 1.5 1.2 1.8 -> 1.500 ± 0.300; f share 0.2 x that -> 0.300 ± 0.060
    assert "Decision tokens: the rule `words` on hit, stick of `scripts/weight_shares.py`" in lcm
    assert "| scgrpo | pooled | 3 | 0.200 ± 0.000 | 0.300 ± 0.060 | 1.500 ± 0.300 | 0.750 ± 0.150 |" in lcm
    assert "| scgrpo | partial | 3 | 0.200 ± 0.000 | 0.600 ± 0.120 | 3.000 ± 0.600 |" in lcm
    assert "| scgrpo-kl-anchor | pooled | 2 | 0.200 ± 0.000 | 0.190 ± 0.042 | 0.950 ± 0.212 |" in lcm
    assert "![lcm: weight concentration per logged step](replication/round2_lcm_concentration.png)" in lcm
    # the setup, from the configs and the files
    assert ("- **lcm** (`configs/replication/lcm.yaml`): prompts from `scgrpo.data.ReasoningGymTask` "
            '(`task="lcm"`, `config={"max_value": 100}`, `ood_config={"max_value": 1000}`, `num_eval=32`); 30 steps '
            "of 16 prompts x G = 8, at most 256 new tokens a completion, temperature 1, lr 0.0002.") in section
    assert "(episodes of up to 4 model turns, 128 tokens in all)" in section and "64 ID and 64 OOD problems" in section
    assert "greedy accuracy on 32 ID and 32 OOD problems, every 15 steps" in section
    assert "  - `python scripts/replicate.py --plan main,extra --tasks blackjack`" in section
    # blackjack at its config's rate only: 3 GRPO seeds, not 4
    assert "| grpo | 3 | 0.400 ± 0.100 |" in section[section.index("### blackjack"):]


def test_steps_without_a_batch_are_counted_and_left_out_of_the_final_length():
    run = {"steps": {"reward": [0.5, 0.2, None, None], "completion_length": [10.0, 30.0, None, None]}}
    assert rep.trained_steps(run) == 2  # DAPO kept no group on the last two steps
    assert rep.last_median(run, "completion_length") == 20.0


def test_second_round_conclusions_and_missing_runs(tmp_path, monkeypatch):
    page, _, _ = _second_round(tmp_path, monkeypatch)
    closing = page[page.index("### What the second round shows"):]
    lcm = next(line for line in closing.splitlines() if line.startswith("- **lcm**"))
    blackjack = next(line for line in closing.splitlines() if line.startswith("- **blackjack**"))
    assert ("SC-GRPO beat GRPO beyond seed noise on ID and OOD Avg@8 (ID Avg@8 +0.100, 95% interval [+0.075, "
            "+0.125], higher; OOD Avg@8 +0.100, 95% interval [+0.075, +0.125], higher).") in lcm
    # SC-GRPO - DAPO, ID Avg@8: -0.05 +0.11 -0.11: mean -0.017, within noise
    assert "SC-GRPO did not beat DAPO beyond seed noise (ID Avg@8 -0.017, 95% interval" in lcm
    assert ("SC-GRPO's weight concentrates on decision tokens (concentration above 1 in every seed: 1.50 (seed 0), "
            "1.20 (seed 1), 1.80 (seed 2)).") in lcm
    assert ("SC-GRPO + anchor's weight is mixed (concentration above 1 in some seeds, not in others: 0.80 (seed 0), "
            "1.10 (seed 1)).") in lcm
    assert ("The KL anchor changed none of the four metrics beyond seed noise; completion length 40.0 against 20.0 "
            "tokens (paired +20.0, higher).") in lcm
    # blackjack: ID Avg@8 +0.05 -0.05 +0.10: mean +0.033, sd 0.076, half-width 0.189: within noise
    assert "SC-GRPO did not beat GRPO beyond seed noise (ID Avg@8 +0.033, 95% interval [-0.156, +0.223], " in blackjack
    assert "SC-GRPO against DAPO: not compared (no runs of DAPO)." in blackjack
    assert "SC-GRPO's weight leans away from decision tokens (concentration below 1 in every seed" in blackjack
    assert "The KL anchor: not compared (no runs of SC-GRPO + anchor)." in blackjack
    # over the tasks: lcm beat GRPO on ID and OOD, blackjack did not; only lcm ran DAPO
    assert "- **SC-GRPO against GRPO, over the tasks**: beyond seed noise on ID or OOD Avg@8 on 1 of 2 tasks (lcm)." in closing
    assert "- **SC-GRPO against DAPO, over the tasks**: beyond seed noise on ID or OOD Avg@8 on 0 of 1 tasks." in closing
    missing = next(line for line in closing.splitlines() if line.startswith("- **Missing runs**"))
    assert missing == ("- **Missing runs** (fewer than 3 seeds): chain_sum: not run; lcm: scgrpo-kl-anchor (seed 2 "
                       "missing); tool_calc: not run; blackjack: dapo (seeds 0, 1, 2 missing), reinforce-pp (seeds 0, "
                       "1, 2 missing), scgrpo-kl-anchor (seeds 0, 1, 2 missing).")


def test_second_round_summary_by_task(tmp_path, monkeypatch):
    _, summary, _ = _second_round(tmp_path, monkeypatch)
    assert {"task", "methods", "ablations", "countdown", "by_task"} <= set(summary)
    by_task = summary["by_task"]
    assert by_task["scgrpo"]["lcm"]["id_avg8"] == {"mean": 0.5, "std": 0.0954, "seeds": [0.4, 0.51, 0.59]}
    assert by_task["scgrpo-kl-anchor"]["lcm"]["ood_pass8"]["seeds"] == [0.4, 0.49]
    assert by_task["grpo"]["blackjack"]["id_avg8"]["seeds"] == [0.3, 0.4, 0.5]  # the other rate's run left out
    assert by_task["grpo"]["arith"] == summary["methods"]["grpo"]  # the first round, under its task
    assert set(by_task["scgrpo"]) == {"arith", "lcm", "blackjack"} and "reinforce-pp" not in by_task.get("grpo", {})


def test_no_second_round_files_no_second_round(tmp_path):
    run = _run("grpo", 0, (0.4, 0.5, 0.1, 0.2))
    sc = _run("scgrpo", 0, (0.4, 0.5, 0.1, 0.2))
    for r in (run, sc):
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    page, summary, _ = rep.report(str(tmp_path))
    assert "Second round" not in page and "by_task" not in summary
    assert rep.round2_figures(rep.round2_groups([run, sc]), str(tmp_path / "figures")) == []


def test_a_task_without_an_ood_split_leaves_its_ood_metrics_out():
    runs = [_run2("lcm", "grpo", seed, (0.2, 0.4, None, None)) for seed in (0, 1)]
    for run in runs:
        del run["evaluations"][-1]["ood"]
    assert set(rep.summary_block(runs)) == {"id_avg8", "id_pass8"}
    assert rep.round2_results({"grpo": runs})[2].startswith("| grpo | 2 | 0.200 ± 0.000 | 0.400 ± 0.000 | - | - |")


def test_second_round_figures(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    _second_round(tmp_path, monkeypatch)
    written = rep.round2_figures(rep.round2_groups(rep.load(str(tmp_path))), str(tmp_path / "figures"))
    assert sorted(os.path.basename(p) for p in written) == [
        "round2_blackjack.png", "round2_blackjack_concentration.png", "round2_lcm.png", "round2_lcm_concentration.png"]
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in written)


def test_a_method_that_scored_above_sc_grpo_beyond_noise_is_said_so():
    sc = [_run("scgrpo", s, (0.2 + 0.01 * s, 0.5, 0.1, 0.2), task="lcm") for s in range(3)]
    dapo = [_run("dapo", s, (0.5 + 0.02 * s, 0.5, 0.1, 0.2), task="lcm") for s in range(3)]
    # ID Avg@8 differences -0.30 -0.31 -0.32: every seed lower, the interval far below 0; OOD identical
    said = rep.beat({"scgrpo": sc, "dapo": dapo}, "dapo")
    assert said.startswith("SC-GRPO did not beat DAPO beyond seed noise, and scored below it beyond seed noise on ID "
                           "Avg@8 (ID Avg@8 -0.310, 95% interval [-0.335, -0.285], lower;")
    assert rep.beaten_on({"scgrpo": sc, "dapo": dapo}, "dapo") is False
    assert rep.beaten_on({"scgrpo": sc}, "dapo") is None


def test_the_calibration_table_marks_the_settings_trained_on(tmp_path):
    import yaml

    config = yaml.safe_load(open(os.path.join(ROOT, "configs", "replication", "lcm.yaml")))["data"]["source"]["init_args"]
    row = {"task": "lcm", "config": config["config"], "rows": 64, "samples": 8, "pass_at_k": 0.421875, "avg_at_k": 0.0977,
           "mean_length": 165.2, "mean_correct_length": None, "truncated": 0.65}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"command": "python scripts/calibrate_reasoning.py ...", "device": "CPU (2 cores)",
                                "max_new_tokens": 192, "extraction": "tag_or_number",
                                "results": [row, {**row, "config": {"max_value": 99}, "mean_correct_length": 50.4}]}))
    lines = rep.round2_calibration(str(path))
    assert lines[0].startswith("The reasoning_gym settings: the base model's Pass@8 and lengths (tokens) on 64 ID")
    assert f"| lcm | `{json.dumps(config['config'])}` | 0.42 | 0.098 | 165 | - | 0.65 | yes |" in lines
    assert '| lcm | `{"max_value": 99}` | 0.42 | 0.098 | 165 | 50 | 0.65 | no |' in lines
    assert rep.round2_calibration(str(tmp_path / "none.json")) == []
