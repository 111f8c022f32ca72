"""scripts/replicate.py: which runs a plan holds, what a finished run's result file records, and that a run
resumes from its checkpoint and stops cleanly at a deadline."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("replicate", os.path.join(ROOT, "scripts", "replicate.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["replicate"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


replicate = _load()

TINY = ["--trainer.accelerator=cpu", "--model.dtype=float32", "--model.generation.max_new_tokens=5",
        "--trainer.val_check_interval=2", "--checkpoint.every_n_train_steps=2", "--data.max_eval_prompts=2",
        "--data.batch_size=2", "--model.log_completions_every_n_steps=0"]


def _replicate(tmp_path, tiny_model_dir, *args, extra=(), check=True):
    command = [sys.executable, os.path.join(ROOT, "scripts", "replicate.py"), "--gpus=0", f"--model={tiny_model_dir}",
               f"--work-dir={tmp_path / 'work'}", f"--results-dir={tmp_path / 'results'}", *args, "--", *TINY, *extra]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), SCGRPO_CACHE=str(tmp_path / "cache"))
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_plans_name_each_run_once_and_the_sweep_shares_the_main_tables_grpo_runs():
    lr = replicate.config_lr("arith")
    main = replicate.plan_runs(["main"], ["arith"], [0, 1, 2])
    assert len(main) == len(replicate.MAIN) * 3
    assert {r.method for r in main} == set(replicate.MAIN) and {r.lr for r in main} == {lr}
    sweep = replicate.plan_runs(["lr"], ["arith"], [0, 1, 2])
    assert len(sweep) == len(replicate.LR_GRID) * 3 and {r.method for r in sweep} == {"grpo"}
    both = replicate.plan_runs(["lr", "main"], ["arith"], [0, 1, 2])
    shared = {r.name for r in sweep} & {r.name for r in main}
    assert lr in replicate.LR_GRID and len(shared) == 3  # GRPO x 3 seeds at the config's rate
    assert len(both) == len(sweep) + len(main) - len(shared)
    ablations = replicate.plan_runs(["ablations"], ["arith"], [0])
    assert {r.method for r in ablations} == set(replicate.ABLATIONS)
    extra = replicate.plan_runs(["extra"], ["countdown"], [0, 1], ["scgrpo-group-window"])
    assert [(r.task, r.method, r.seed) for r in extra] == [("countdown", "scgrpo-group-window", s) for s in (0, 1)]
    assert not set(replicate.EXTRA) & (set(replicate.MAIN) | set(replicate.ABLATIONS))  # first-round tables unchanged
    for method, layer in replicate.METHODS.items():  # every layer exists and holds only an objective
        import yaml

        with open(os.path.join(ROOT, "configs", layer)) as f:
            assert set(yaml.safe_load(f)) == {"model"} and set(yaml.safe_load(open(os.path.join(ROOT, "configs", layer)))["model"]) == {"objective"}, method
    run = replicate.Run("arith", "grpo", 1, 5e-4)
    assert run.name == "arith_grpo_lr5e-4_seed1" and "--model.optimizer.init_args.lr=0.0005" in run.fit_args()
    assert not any("optimizer" in a for a in replicate.Run("arith", "grpo", 1, lr).fit_args())
    with pytest.raises(SystemExit, match="unknown plan"):
        replicate.plan_runs(["everything"], ["arith"], [0])
    with pytest.raises(SystemExit, match="unknown methods"):
        replicate.plan_runs(["main"], ["arith"], [0], ["grpo", "ppo"])


@pytest.mark.slow
def test_finished_runs_record_evaluations_steps_and_rollouts_and_are_skipped(tiny_model_dir, tmp_path):
    done = _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=grpo,dapo", "--seeds=0", "--jobs=2",
                      extra=["--trainer.max_steps=4"])
    assert "finished 2, failed 0" in done.stdout
    grpo = json.load(open(tmp_path / "results" / "arith_grpo_lr2e-4_seed0.json"))
    assert grpo["method"] == "grpo" and grpo["seed"] == 0 and grpo["segments"] == 1
    assert grpo["commands"] == [grpo["commands"][0]] and "--methods=grpo,dapo" in grpo["commands"][0]
    assert grpo["fit"].startswith("scgrpo fit --config=configs/replication/arith.yaml --config=configs/replication/grpo.yaml")
    assert grpo["fit_extra"] == [*TINY, "--trainer.max_steps=4"]  # the arguments beyond the configs, as given
    assert [e["step"] for e in grpo["evaluations"]] == [0, 2, 4]  # before training, then every 2 steps
    assert set(grpo["evaluations"][-1]) == {"step", "id", "ood"} and "avg@8" in grpo["evaluations"][-1]["ood"]
    assert grpo["steps"]["step"] == [1, 2, 3, 4]
    g = 8  # the replication's G
    assert grpo["steps"]["rollouts"] == [2.0 * g] * 4 and grpo["rollouts"] == 4 * 2 * g
    dapo = json.load(open(tmp_path / "results" / "arith_dapo_lr2e-4_seed0.json"))
    # the tiny model never answers right: every group is uniform, so DAPO draws its 3 extra rounds every step
    assert dapo["steps"]["dapo_extra_rounds"] == [3.0] * 4 and dapo["rollouts"] == 4 * 4 * 2 * g
    again = _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=grpo,dapo", "--seeds=0",
                       extra=["--trainer.max_steps=4"])
    assert "2 done, 0 to run" in again.stdout


@pytest.mark.slow
def test_an_unfinished_run_resumes_from_its_checkpoint(tiny_model_dir, tmp_path):
    from scgrpo.cli import main

    run = replicate.Run("arith", "scgrpo", 0, replicate.config_lr("arith"))
    work = tmp_path / "work" / run.name
    work.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(work)  # as replicate.py starts it, stopped after 2 of 4 steps
    try:
        main(["fit", *run.fit_args(), f"--trainer.default_root_dir={work}", f"--model.model={tiny_model_dir}", *TINY,
              "--trainer.max_steps=2", "--trainer.enable_progress_bar=false"])
    finally:
        os.chdir(cwd)
    assert (work / "scgrpo" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=scgrpo", "--seeds=0", extra=["--trainer.max_steps=4"])
    log = (work / "log.txt").read_text()
    assert "resume" in log and "--ckpt_path=" in log
    result = json.load(open(tmp_path / "results" / f"{run.name}.json"))
    assert result["steps"]["step"] == [1, 2, 3, 4] and [e["step"] for e in result["evaluations"]] == [0, 2, 4]
    assert all(p is not None for p in result["steps"]["kl_p75"])  # SC-GRPO's signal, before and after the resume


@pytest.mark.slow
def test_the_deadline_pauses_runs_without_a_result_and_the_next_command_finishes_them(tiny_model_dir, tmp_path):
    # a run far longer than the deadline (counted from the command's start, imports included), which must have
    # trained a step for the interruption to write a checkpoint (the assertions below read it): on the 2-core CI
    # machine the run started about 4 s in, was set up by about 10 s and wrote its step-2 checkpoint a second later,
    # under the load of the rest of the suite; 25 s leaves a machine more than twice as slow that time
    paused = _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=grpo", "--seeds=0", "--deadline-s=25",
                        "--grace-s=30", extra=["--trainer.max_steps=100000"])
    assert "deadline: interrupting 1 run(s)" in paused.stdout and "left for a later command 1" in paused.stdout
    name = "arith_grpo_lr2e-4_seed0"
    assert not (tmp_path / "results" / f"{name}.json").exists()
    state = json.load(open(tmp_path / "work" / name / "state.json"))
    assert [s["exit"] for s in state["segments"]] == ["interrupted"]
    last = tmp_path / "work" / name / "scgrpo" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file(), (tmp_path / "work" / name / "log.txt").read_text()[-3000:]  # every 2 steps, and on the stop
    # no time left for a run as long as --run-s: nothing starts
    idle = _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=grpo", "--seeds=0", "--deadline-s=5",
                      "--run-s=60", extra=["--trainer.max_steps=100000"])
    assert "resume" not in idle.stdout and "start" not in idle.stdout and "left for a later command 1" in idle.stdout
    assert len(json.load(open(tmp_path / "work" / name / "state.json"))["segments"]) == 1
    # the next command resumes it from the checkpoint the interruption wrote and trains 4 more steps
    import torch

    reached = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    target = reached - reached % 2 + 4  # even: an evaluation is due after the last step
    _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=grpo", "--seeds=0",
               extra=[f"--trainer.max_steps={target}"])
    assert "resume" in (tmp_path / "work" / name / "log.txt").read_text()
    result = json.load(open(tmp_path / "results" / f"{name}.json"))
    assert result["segments"] == 2 and result["steps"]["step"] == list(range(1, target + 1))
    assert [e["step"] for e in result["evaluations"]] == list(range(0, target + 1, 2))


def test_slots_alternate_gpus_and_unfinished_metrics_are_not_a_result():
    assert [s.gpu for s in replicate.make_slots(4, 2, 1)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [s.gpu for s in replicate.make_slots(0, 4, 3)] == [None] * 3

    def metrics(steps, evaluated):
        return {"steps": {"step": steps}, "evaluations": [{"step": e} for e in evaluated]}

    assert replicate.incomplete(metrics([1, 2, 3, 4], [0, 2, 4]), 4, 2) is None
    assert "missing [3]" in replicate.incomplete(metrics([1, 2, 4, 5], [0, 2, 4]), 4, 2)  # a step logged one ahead
    assert "no evaluation after its last step 4" in replicate.incomplete(metrics([1, 2, 3, 4], [0, 2]), 4, 2)
    assert replicate.incomplete(metrics([1, 2, 3], [0, 2]), 3, 2) is None  # no evaluation due after step 3


@pytest.mark.slow
def test_a_failing_run_is_reported_with_its_log_and_the_command_fails(tiny_model_dir, tmp_path):
    done = _replicate(tmp_path, tiny_model_dir, "--plan=main", "--methods=grpo", "--seeds=0",
                      extra=["--trainer.max_steps=4", "--model.generation.num_generations=1"], check=False)
    assert done.returncode != 0 and "FAILED arith_grpo_lr2e-4_seed0" in done.stdout
    assert "num_generations" in done.stdout  # the run's own error, from its log
    assert not (tmp_path / "results").exists() or not os.listdir(tmp_path / "results")


def test_the_countdown_task_config_runs_with_a_method_layer(tiny_model_dir, tmp_path, monkeypatch):
    from scgrpo.cli import main

    monkeypatch.chdir(tmp_path)
    run = replicate.Run("countdown", "scgrpo", 0, replicate.config_lr("countdown"))
    main(["fit", *run.fit_args(), f"--model.model={tiny_model_dir}", *TINY, "--trainer.max_steps=2",
          "--data.source.init_args.num_train=20"])
    metrics = replicate.read_metrics(str(next((tmp_path / "runs" / "scgrpo").glob("version_*"))))
    assert metrics["steps"]["step"] == [1, 2] and [e["step"] for e in metrics["evaluations"]] == [0, 2]
    assert metrics["evaluations"][0]["ood"]["avg@8"] == 0.0  # the countdown verifier scored 4-number problems


def test_a_pid_file_holds_a_run_only_while_its_process_trains_it_and_a_broken_record_starts_again(tmp_path):
    work = tmp_path / "work" / "arith_grpo_lr2e-4_seed0"
    work.mkdir(parents=True)
    assert replicate.busy(str(work)) is None  # no pid file
    sleeper = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(30)", str(work)])
    try:
        for _ in range(200):  # until the child has exec'd (before, its command line is still this process's)
            with open(f"/proc/{sleeper.pid}/cmdline", "rb") as f:
                if str(work).encode() in f.read():
                    break
            time.sleep(0.01)
        (work / "pid").write_text(str(sleeper.pid))
        assert replicate.busy(str(work)) == sleeper.pid  # alive, and training this folder (its command names it)
        (work / "pid").write_text(str(os.getppid()))  # alive, but another program: the pid was given away
        assert replicate.busy(str(work)) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    (work / "pid").write_text(str(sleeper.pid))  # gone
    assert replicate.busy(str(work)) is None
    (work / "state.json").write_text('{"segments": [{"wall_s": 1')  # cut off mid-write by a kill
    state = replicate.State.load(str(work / "state.json"))
    assert state.segments == []
    state.segments.append({"wall_s": 2.0, "exit": 0})
    state.save()
    assert replicate.State.load(str(work / "state.json")).segments == [{"wall_s": 2.0, "exit": 0}]


def test_weight_shares_land_in_the_result_under_each_tasks_rule(tmp_path):
    assert replicate.decision_rule("tool_calc") == ("tool", ("calc",))
    rule, moves = replicate.decision_rule("blackjack")
    assert rule == "words" and {"hit", "stick", "stand"} <= set(moves)
    assert replicate.decision_rule("arith") == ("arith", ()) and replicate.decision_rule("unknown") is None
    tokens = tmp_path / "credit_tokens.jsonl"
    row = {"step": 0, "row": 0, "route": "partial", "has_teacher": True, "tokens": ["I", " hit", " now"],
           "model": [1, 1, 1], "f": [0.2, 0.9, 0.1]}
    tokens.write_text(json.dumps(row) + "\n" + json.dumps({**row, "row": 1, "has_teacher": False}) + "\n")
    shares = replicate.weight_shares_of("blackjack", str(tokens))
    assert shares["rule"] == "words" and "hit" in shares["names"]
    assert shares["overall"]["partial"]["decision_f_share"] == pytest.approx(0.9 / 1.2)
    assert replicate.weight_shares_of("arith", str(tokens))["overall"]["pooled"]["decision_tokens"] == 0
    assert replicate.weight_shares_of("blackjack", str(tmp_path / "none.jsonl")) is None  # logged no weights


@pytest.mark.parametrize("task", ["lcm", "blackjack"])
def test_the_second_round_task_configs_train_and_log_their_weight_shares(task, tiny_model_dir, tmp_path, monkeypatch):
    """A reasoning_gym task and the packaged environment, each under SC-GRPO for two steps: both evaluation splits
    scored, and the logged token weights split by the task's rule into the result's weight shares."""
    pytest.importorskip("reasoning_gym" if task == "lcm" else "gymnasium")
    from scgrpo.cli import main

    monkeypatch.chdir(tmp_path)
    run = replicate.Run(task, "scgrpo", 0, replicate.config_lr(task))
    small = ["--data.source.init_args.num_train=20", "--model.generation.max_new_tokens=4"]
    if task == "blackjack":
        small += ["--model.episodes.max_episode_tokens=24"]
    main(["fit", *run.fit_args(), f"--model.model={tiny_model_dir}", *TINY, "--trainer.max_steps=2",
          "--model.log_completions_every_n_steps=1", *small])
    folder = next((tmp_path / "runs" / "scgrpo").glob("version_*"))
    metrics = replicate.read_metrics(str(folder))
    assert [e["step"] for e in metrics["evaluations"]] == [0, 2]
    assert {"id", "ood"} <= set(metrics["evaluations"][0])
    shares = replicate.weight_shares_of(task, str(folder / "credit_tokens.jsonl"))
    rows = [json.loads(line) for line in open(folder / "credit_tokens.jsonl")]
    teacher_tokens = sum(sum(r["model"]) for r in rows if r["has_teacher"])
    if teacher_tokens:  # the tiny model rarely earns a teacher; where none, nothing is reported
        assert shares["rule"] == replicate.decision_rule(task)[0]
        assert shares["overall"]["pooled"]["tokens"] == teacher_tokens
    else:
        assert shares is None


def test_runs_that_share_a_card_split_its_memory():
    assert replicate.shared_gpu_budget(["--x=1"], gpus=4, per_gpu=8, free_gib=140.0) == [
        "--x=1", "--model.memory_budget_gib=15.8"]  # 0.9 x 140 / 8
    assert replicate.shared_gpu_budget([], 4, 8, free_gib=4.0) == ["--model.memory_budget_gib=1.0"]  # the floor
    for given in (["--model.memory_budget_gib=14"], ["--model.generation.memory_budget_gib", "9"],
                  ["--config=budget.yaml"]):  # a budget the user set (or may have set in a config) stays theirs
        assert replicate.shared_gpu_budget(given, 4, 8, free_gib=140.0) == given
    assert replicate.shared_gpu_budget([], gpus=1, per_gpu=1, free_gib=140.0) == []  # a run alone sizes itself
    assert replicate.shared_gpu_budget([], gpus=0, per_gpu=8) == []  # on the CPU: no card


def test_the_pivot_rows_kept_from_a_credit_tokens_file_by_hand(tmp_path):
    """Only failed rows of partial-solve groups with a teacher that mark a decision; their model tokens' f, label
    and turn (environment tokens dropped); a step logged again (a resumed run) keeps its last block."""

    def row(step, index, route="partial", teacher=True, reward=0.0, decision=(2, 0, 0, 1), model=(1, 0, 1, 1)):
        return {"step": step, "row": index, "group": index // 2, "route": route, "has_teacher": teacher,
                "reward": reward, "f": [0.9, 1.0, 0.2, 0.4], "model": list(model), "decision": list(decision)}

    lines = [row(1, 0), row(1, 1, reward=1.0), row(1, 2, route="solve_none"), row(1, 3, teacher=False),
             row(1, 4, decision=(0, 0, 0, 0)),
             row(2, 0, decision=(1, 0, 0, 0)),  # step 2, logged twice: the first block is dropped
             row(2, 0, decision=(0, 0, 2, 2), model=(1, 1, 0, 1))]
    path = tmp_path / "credit_tokens.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert replicate.pivot_tokens_of(str(path)) == [
        {"step": 1, "group": 0, "f": [0.9, 0.2, 0.4], "decision": [2, 0, 1], "turn": [0, 1, 1]},
        {"step": 2, "group": 0, "f": [0.9, 1.0, 0.4], "decision": [0, 0, 2], "turn": [0, 0, 1]}]
    assert replicate.pivot_tokens_of(str(tmp_path / "missing.jsonl")) == []
