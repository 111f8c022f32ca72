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


def _shares(concentration, tokens=100):
    """A weight-shares summary with a given concentration: a fifth of the tokens are decisions, the rest have mean f
    0.5, and the decisions' mean f a = 2c / (5 - c) makes their f share a / (a + 2) = c / 5."""
    decision = tokens // 5
    a = 2 * concentration / (5 - concentration)
    return {"tokens": tokens, "decision_tokens": decision, "decision_token_share": decision / tokens,
            "decision_f_share": a / (a + 2), "concentration": concentration, "mean_f_decision": a, "mean_f_other": 0.5}


def _weights(concentration, base=0.9, version=2, later=True):
    """Made-up weight shares: step 1 (the base policy's rollouts) at ``base``; with ``later``, steps 15 and 30 at
    concentration -/+ 0.1 (so their mean is ``concentration``); always a step 20 of 50 tokens at 4.0, too few to
    count. The partial route has twice the pooled concentration, solve-none 1.0."""
    def step(c, tokens=100):
        return {"pooled": _shares(c, tokens), "partial": _shares(2 * c, tokens), "solve_none": _shares(1.0, tokens)}

    by_step = {"1": step(base), "20": {**step(4.0, 50), "partial": _shares(1.0, 50)}}
    if later:
        by_step.update({"15": step(concentration - 0.1), "30": step(concentration + 0.1)})
    shares = {"rule": "words", "names": ["hit", "stick"], "overall": {"pooled": _shares(1.0, 400)}, "by_step": by_step}
    return {**shares, **({"rule_version": version} if version else {})}


def _run2(task, method, seed, finals, lr=2e-4, length=20.0, entropy=(1.0, 0.5), concentration=None, wall=100.0,
          weights=None):
    """A made-up second-round result file: 30 steps; the completion length is 100 over the first 10 steps and
    ``length`` over the last 20; the entropy is entropy[0] at the first step and entropy[1] after; weight shares
    from :func:`_weights` (given ``concentration``, or whole as ``weights``)."""
    ia, ip, oa, op = finals
    run = _run(method, seed, (ia, ip, oa, op), steps=30, task=task, lr=lr)
    run["name"] = f"{task}_{method}_lr{lr:.0e}_seed{seed}".replace("e-0", "e-")
    run["gpus"] = 4
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
    if weights is not None or concentration is not None:
        run["weight_shares"] = weights or _weights(concentration)
    return run


def _second_round(tmp_path, monkeypatch):
    """Made-up files: the first round (arith: GRPO and SC-GRPO, 2 seeds) and two second-round tasks.

    lcm: GRPO, DAPO, REINFORCE++ and SC-GRPO on seeds 0-2, the anchor on seeds 0-1 (seed 2 missing).
      ID Avg@8  GRPO 0.30 0.40 0.50; SC-GRPO 0.40 0.51 0.59; DAPO 0.45 0.40 0.70; REINFORCE++ 0.20 0.20 0.20
      OOD Avg@8 GRPO 0.10 0.20 0.30; SC-GRPO 0.20 0.29 0.41; DAPO 0.20 0.20 0.40; REINFORCE++ 0.10 0.10 0.10
      Pass@8 = Avg@8 + 0.2 everywhere; the anchor's finals are SC-GRPO's.
    blackjack (config lr 1e-4): GRPO and SC-GRPO, seeds 0-2; ID Avg@8 GRPO 0.30 0.40 0.50, SC-GRPO 0.35 0.35 0.60;
      one GRPO run at another rate, left out.
    SC-GRPO's concentration after step 1 (:func:`_weights`): lcm 1.5 1.2 1.8 (the anchor 0.8 1.1), blackjack 0.5 0.8
      and none in seed 2; at step 1: lcm 0.9, blackjack 1.3.
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
        # blackjack's shares: version 1 of the words rule (no version recorded); seed 2 logged nothing that counts
        # after step 1
        weights = _weights([0.5, 0.8, 0.9][seed], base=1.3, version=None, later=seed < 2)
        runs += [_run2("blackjack", "grpo", seed, f(g, g), lr=1e-4),
                 _run2("blackjack", "scgrpo", seed, f(s, s), lr=1e-4, weights=weights)]
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
    # weight shares: step 1 apart (0.9 in every seed); after it the mean of steps 15 and 30, c -/+ 0.1 with c = 1.5
    # 1.2 1.8 -> 1.500 ± 0.300 (step 20, 50 tokens, left out: 2 steps and 200 tokens per seed); the pooled f share of
    # the two steps: (a1 + a2) / (a1 + a2 + 4) with a = 2c / (5 - c), a fifth of the tokens decisions
    assert "Decision tokens: the rule `words` on hit, stick of `scripts/weight_shares.py`" in lcm
    assert "| scgrpo | pooled | 3 | 0.900 ± 0.000 | 1.500 ± 0.300 | 2/2/2 | 200/200/200 | 0.200 ± 0.000 |" in lcm
    a = [[2 * c / (5 - c) for c in (m - 0.1, m + 0.1)] for m in (1.5, 1.2, 1.8)]
    f_shares = [sum(x) / (sum(x) + 4) for x in a]
    assert f"| 0.200 ± 0.000 | {rep.ms(f_shares)} | {rep.ms([sum(x) / 2 for x in a])} | 0.500 ± 0.000 |" in lcm
    assert "| scgrpo | partial | 3 | 1.800 ± 0.000 | 3.000 ± 0.600 | 2/2/2 |" in lcm
    assert "| scgrpo-kl-anchor | pooled | 2 | 0.900 ± 0.000 | 0.950 ± 0.212 | 2/2 |" in lcm
    assert "Note:" not in lcm  # version 2 of the words rule, the current one
    assert "step 20" not in lcm and "read at a logged step only when the route has at least 100" in lcm
    blackjack = section[section.index("### blackjack"):]
    assert "| scgrpo | pooled | 3 | 1.300 ± 0.000 | 0.650 ± 0.212 (2 of 3 seeds) | 2/2/0 | 200/200/0 |" in blackjack
    assert ("Note: these shares were computed under version 1 of the `words` rule, and `scripts/weight_shares.py` "
            "now applies version 2 (only the first move of each model turn counts") in blackjack
    # the setup says the GPUs of the result files
    assert "Ran on 4 GPUs (TEST), 1 at a time per GPU (14 runs)." in section
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
    # 1.5 1.2 1.8: above 1 in every seed, but mean 1.5, sd 0.3, half-width 4.303 x 0.3 / sqrt(3) = 0.745
    assert ("SC-GRPO's concentration after step 1 is above 1 in every seed: 1.50 (seed 0: 2 steps, 200 tokens), "
            "1.20 (seed 1: 2 steps, 200 tokens), 1.80 (seed 2: 2 steps, 200 tokens); mean 1.50, 95% interval "
            "[0.75, 2.25]: no clear lean. At step 1 (the base policy's rollouts): 0.90 (seed 0), 0.90 (seed 1), "
            "0.90 (seed 2).") in lcm
    assert ("SC-GRPO + anchor's concentration after step 1 is mixed (above 1 in some seeds, not in others): 0.80 "
            "(seed 0: 2 steps, 200 tokens), 1.10 (seed 1: 2 steps, 200 tokens); mean 0.95, 95% interval [-0.96, "
            "2.86]: no clear lean.") in lcm
    assert ("The KL anchor changed none of the four metrics beyond seed noise; completion length 40.0 against 20.0 "
            "tokens (paired +20.0, higher).") in lcm
    # blackjack: ID Avg@8 +0.05 -0.05 +0.10: mean +0.033, sd 0.076, half-width 0.189: within noise
    assert "SC-GRPO did not beat GRPO beyond seed noise (ID Avg@8 +0.033, 95% interval [-0.156, +0.223], " in blackjack
    assert "SC-GRPO against DAPO: not compared (no runs of DAPO)." in blackjack
    assert ("SC-GRPO's concentration after step 1 (under version 1 of the `words` rule, not 2) is below 1 in every "
            "seed: 0.50 (seed 0: 2 steps, 200 tokens), 0.80 (seed 1: 2 steps, 200 tokens); seed 2: no teacher rows "
            "after the first step at a logged step with 100 teacher tokens or more (1 step with fewer, 50 tokens in "
            "all); mean 0.65, 95% interval [-1.26, 2.56]: no clear lean. At step 1 (the base policy's rollouts): "
            "1.30 (seed 0), 1.30 (seed 1), 1.30 (seed 2).") in blackjack
    # the anchor's made-up finals are SC-GRPO's: on lcm the two converged to the same scores
    assert lcm.startswith("- **lcm**: No headroom: methods converged to the same scores, SC-GRPO and SC-GRPO + anchor "
                          "have the same final ID and OOD Avg@8 in every seed. SC-GRPO beat GRPO")
    assert blackjack.startswith("- **blackjack**: SC-GRPO did not beat GRPO")
    assert "The KL anchor: not compared (no runs of SC-GRPO + anchor)." in blackjack
    # over the tasks: lcm beat GRPO on ID and OOD, blackjack did not; only lcm ran DAPO
    assert ("- **SC-GRPO against GRPO, over the tasks**, beyond seed noise on ID or OOD Avg@8: above it on 1 of 2 "
            "tasks (lcm); below it on 0 of 2 tasks.") in closing
    assert ("- **SC-GRPO against DAPO, over the tasks**, beyond seed noise on ID or OOD Avg@8: above it on 0 of 1 "
            "tasks; below it on 0 of 1 tasks.") in closing
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
    assert lines[0].startswith("The reasoning_gym settings: the base model's Pass@8 and lengths (tokens) on the ID "
                               "split's first 64 problems of each setting")
    assert f"| lcm | `{json.dumps(config['config'])}` | 0.42 | 0.098 | 165 | - | 0.65 | yes |" in lines
    assert '| lcm | `{"max_value": 99}` | 0.42 | 0.098 | 165 | 50 | 0.65 | no |' in lines
    assert rep.round2_calibration(str(tmp_path / "none.json")) == []


def test_the_calibration_caption_says_how_answers_are_read():
    path = os.path.join(ROOT, "benchmarks", "results", "reasoning", "calibration.json")
    caption = rep.round2_calibration(path)[0]
    assert "on the ID split's first 64 problems of each setting (the same problems its evaluation uses first" in caption
    assert ("Answers read with `extraction: tag_or_number`, our choice, not reasoning_gym's (which reads only an "
            "`<answer>` block): a completion without an `<answer>` block is scored 1 if its last number equals the "
            "answer, else 0; a block is scored by the task's own scorer (which can give partial credit).") in caption


def test_the_concentration_after_the_first_step_by_hand():
    run = {"seed": 0, "weight_shares": _weights(1.5)}
    assert rep.base_step(run) == "1" and rep.base_concentration(run) == 0.9
    assert [step for step, _ in rep.counted_steps(run)] == [15, 30]  # step 20 has 50 tokens: too few
    after = rep.trained(run)
    assert after["concentration"] == pytest.approx(1.5) and (after["steps"], after["tokens"]) == (2, 200)
    # pooled by hand: 40 decision tokens of 200, f mass 20 a1 + 20 a2 on them and 160 x 0.5 on the rest
    a1, a2 = 2 * 1.4 / 3.6, 2 * 1.6 / 3.4
    assert after["pooled"]["decision_token_share"] == pytest.approx(0.2)
    assert after["pooled"]["decision_f_share"] == pytest.approx(20 * (a1 + a2) / (20 * (a1 + a2) + 80))
    assert after["pooled"]["mean_f_decision"] == pytest.approx((a1 + a2) / 2)
    # a first logged step after step 1 is not the base policy's: every step counts
    late = {"seed": 0, "weight_shares": {"rule": "words", "by_step": {"11": {"pooled": _shares(0.5)},
                                                                      "21": {"pooled": _shares(0.7)}}}}
    assert rep.base_step(late) is None and rep.trained(late)["concentration"] == pytest.approx(0.6)
    only_base = {"seed": 3, "weight_shares": _weights(1.0, later=False)}
    assert rep.trained(only_base) is None
    none_later = {"seed": 4, "weight_shares": {"rule": "words", "by_step": {"1": {"pooled": _shares(1.2)}}}}
    assert rep.no_rows(none_later) == "no teacher rows after the first step"
    said = rep.concentrates({"scgrpo": [none_later]}, "scgrpo")
    assert said == ("SC-GRPO: no teacher rows after the first step, in any seed (seed 4: no teacher rows after the "
                    "first step). At step 1 (the base policy's rollouts): 1.20 (seed 4).")


def test_the_lean_over_seeds_needs_the_interval_on_one_side_of_1():
    # 1.2 1.3 1.25: mean 1.25, sd 0.05, half-width 4.303 x 0.05 / sqrt(3) = 0.124
    assert rep.lean([1.2, 1.3, 1.25]) == "mean 1.25, 95% interval [1.13, 1.37]: concentrates on decision tokens"
    assert rep.lean([0.7, 0.8, 0.75]) == "mean 0.75, 95% interval [0.63, 0.87]: leans away from decision tokens"
    assert rep.lean([0.9, 1.5, 1.2]).endswith(": no clear lean")
    assert rep.lean([1.4]) == "one seed (1.40): no interval, no verdict"
    runs = [{"seed": s, "weight_shares": _weights(c)} for s, c in enumerate((1.2, 1.3, 1.25))]
    said = rep.concentrates({"scgrpo": runs}, "scgrpo")
    assert said.startswith("SC-GRPO's concentration after step 1 is above 1 in every seed: 1.20 (seed 0: 2 steps, "
                           "200 tokens),")
    assert "; mean 1.25, 95% interval [1.13, 1.37]: concentrates on decision tokens. At step 1" in said


def _four(task, scores, pass8=None):
    """Runs of GRPO, DAPO and SC-GRPO on seeds 0-2: ``scores[method]`` = per seed (ID Avg@8, OOD Avg@8); ID Pass@8
    ``pass8`` (else Avg@8 + 0.2)."""
    return {m: [_run2(task, m, seed, (ia, ia + 0.2 if pass8 is None else pass8, oa, oa + 0.2))
                for seed, (ia, oa) in enumerate(per_seed)] for m, per_seed in scores.items()}


def test_no_headroom_flags():
    same = [(0.344, 0.406)] * 3
    converged = _four("blackjack", {"grpo": same, "dapo": same, "scgrpo": same,
                                    "reinforce-pp": [(0.344, 0.406), (0.3, 0.4), (0.344, 0.406)]})
    assert rep.same_scores(converged) == [["grpo", "dapo", "scgrpo"]]
    assert rep.headroom(converged) == ["methods converged to the same scores, GRPO, DAPO and SC-GRPO have the same "
                                       "final ID and OOD Avg@8 in every seed"]
    full = _four("tool_calc", {"grpo": [(0.99, 0.98)] * 3, "scgrpo": [(0.98, 0.99), (0.97, 0.99), (1.0, 1.0)]},
                 pass8=1.0)
    assert rep.headroom(full) == ["saturated, every method's mean final ID Pass@8 is 0.99 or more"]
    full["scgrpo"][0]["evaluations"][-1]["id"]["pass@8"] = 0.96  # mean (0.96 + 1 + 1) / 3 = 0.987 < 0.99
    assert rep.headroom(full) == []
    # the same scores in one shared seed only are not convergence
    one = {"grpo": [_run2("lcm", "grpo", 0, (0.5, 0.7, 0.2, 0.4))], "scgrpo": [_run2("lcm", "scgrpo", 0, (0.5, 0.7, 0.2, 0.4))]}
    assert rep.same_scores(one) == []


def test_the_closing_counts_tasks_below_as_well_as_above():
    up = [(0.5 + 0.01 * s, 0.3) for s in range(3)]
    down = [(0.2 + 0.01 * s, 0.3) for s in range(3)]
    flat = [(0.3, 0.3)] * 3
    second = {
        "chain_sum": _four("chain_sum", {"grpo": flat, "dapo": up, "scgrpo": [(0.41, 0.3), (0.42, 0.3), (0.43, 0.3)]}),
        "lcm": _four("lcm", {"grpo": up, "dapo": [(0.6 + 0.01 * s, 0.3) for s in range(3)], "scgrpo": down}),
        "tool_calc": _four("tool_calc", {"grpo": flat, "scgrpo": flat}, pass8=1.0),
        "blackjack": {},
    }
    lines = rep.round2_conclusions(second)
    # chain_sum: SC-GRPO above GRPO (ID +0.11 +0.12 +0.13), below DAPO (-0.09 in every seed); lcm: below both;
    # tool_calc: the same scores as GRPO, and saturated; no DAPO there
    assert lines[0] == ("- **SC-GRPO against GRPO, over the tasks**, beyond seed noise on ID or OOD Avg@8: above it "
                        "on 1 of 3 tasks (chain_sum); below it on 1 of 3 tasks (lcm).")
    assert lines[1] == ("- **SC-GRPO against DAPO, over the tasks**, beyond seed noise on ID or OOD Avg@8: above it "
                        "on 0 of 2 tasks; below it on 2 of 2 tasks (chain_sum, lcm).")
    tool = next(line for line in lines if line.startswith("- **tool_calc**"))
    assert tool.startswith("- **tool_calc**: No headroom: saturated, every method's mean final ID Pass@8 is 0.99 or "
                           "more; methods converged to the same scores, GRPO and SC-GRPO have the same final ID and "
                           "OOD Avg@8 in every seed. SC-GRPO did not beat GRPO beyond seed noise")
    assert next(line for line in lines if line.startswith("- **lcm**")).startswith("- **lcm**: SC-GRPO did not beat")


def test_the_closing_sets_trained_lengths_against_the_calibrated_one(tmp_path):
    import yaml

    config = yaml.safe_load(open(os.path.join(ROOT, "configs", "replication", "lcm.yaml")))["data"]["source"]["init_args"]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"results": [{"task": "lcm", "config": config["config"], "mean_correct_length": 88.4}]}))
    runs = {"grpo": [_run("grpo", s, (0.4, 0.5, 0.1, 0.2), task="lcm") for s in range(2)],
            "scgrpo": [_run("scgrpo", s, (0.4, 0.5, 0.1, 0.2), task="lcm") for s in range(2)]}
    for r in runs["grpo"]:
        r["steps"]["completion_length"] = [60.0] * 4
    for r, last in zip(runs["scgrpo"], (10.0, 20.0)):
        r["steps"]["completion_length"] = [50.0, 50.0, last, last]
    # SC-GRPO's last steps: medians 50/10 -> 30 and 50/20 -> 35; mean 32.5
    assert rep.lengths_said("lcm", runs, str(path)) == [
        "The base model's correct completions took 88 tokens; trained, the methods' final completions (all rollouts) "
        "took 32.5 to 60.0 tokens, under the 40-token floor the settings were chosen for with SC-GRPO."
        + rep.shortcut_said("lcm")]
    assert rep.lengths_said("blackjack", runs, str(path)) == []  # not a calibrated task


def test_the_largest_number_shortcut_on_lcm_by_hand():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    import yaml

    init = yaml.safe_load(open(os.path.join(ROOT, "configs", "replication", "lcm.yaml")))["data"]["source"]["init_args"]
    rows = reasoning_gym.create_dataset("lcm", seed=1235, size=init["num_eval"], **init["config"])  # the id split
    hits = [e for e in rows if int(e["answer"]) == max(e["metadata"]["numbers"])]  # lcm(a, b) = max: one divides the other
    assert all(max(e["metadata"]["numbers"]) % min(e["metadata"]["numbers"]) == 0 for e in hits)
    assert rep.shortcut_said("lcm") == (f" Answering the largest number given is right on {len(hits)} of the "
                                        f"{len(rows)} ID problems ({len(hits) / len(rows):.3f}), a shortcut that needs "
                                        "no working.")
    assert rep.shortcut_said("blackjack") == ""  # not a reasoning_gym task
