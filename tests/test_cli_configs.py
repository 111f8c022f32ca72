"""Every shipped YAML parses and runs 2 steps with the tiny model; CLI plug-ins and error messages."""

import csv
import glob
import os

import pytest

from scgrpo.cli import main
from tests.data.test_sources import BAD_FILES, write_bad_file

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))
ABLATIONS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "ablations", "*.yaml")))
BASE = os.path.join(os.path.dirname(__file__), "..", "configs", "scgrpo_arith.yaml")
QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
CREDIT_KEYS = ["credit/c", "credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all",
               "credit/kl_p25", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95", "credit/f_mean",
               "credit/f_above_half", "credit/div_adv_std", "policy/entropy"]


def _tiny_args(tiny_model_dir):
    return [
        f"--model.model={tiny_model_dir}",
        "--model.dtype=float32",
        "--model.generation.max_new_tokens=6",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.enable_progress_bar=false",
        "--data.max_eval_prompts=4",
        "--data.batch_size=2",
    ]


def test_there_are_configs():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"quickstart.yaml", "grpo_arith_gpu.yaml"} | {f"{n}_arith.yaml" for n in ("scgrpo", "grpo", "drgrpo", "dapo", "selfdistill", "opsd")} <= names
    ablations = {os.path.basename(c) for c in ABLATIONS}
    assert {"route_partial_only.yaml", "route_single.yaml", "route_all.yaml", "c_p50.yaml", "c_p75.yaml", "c_p90.yaml",
            "c_fixed.yaml", "alpha_0.1.yaml", "alpha_0.2.yaml", "additive_forward_kl.yaml", "opsd_oracle.yaml",
            "buffer_references.yaml"} <= ablations
    assert {"qlora_scgrpo_arith.yaml", "qlora_grpo_arith.yaml", "qlora_scgrpo_consumer.yaml", "fsdp_scgrpo_arith.yaml",
            "fsdp_grpo_arith.yaml"} <= names


SINGLE_PROCESS = [c for c in CONFIGS if not os.path.basename(c).startswith("fsdp_")]  # fsdp: tests/distributed


@pytest.mark.parametrize("config", SINGLE_PROCESS, ids=os.path.basename)
def test_config_runs_two_steps_with_the_tiny_model(config, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = ["--model.quantization=null"] if os.path.basename(config).startswith("qlora_") else []  # 4-bit: GPU only
    if os.path.basename(config).endswith("_code.yaml"):  # each completion is a sandboxed program: one evaluation
        extra += ["--model.validate_before_training=false", "--model.eval_samples=2"]
    if os.path.basename(config) == "env_doors.yaml":  # the tiny tokenizer spends a token a byte: the worked rooms
        extra += ["--model.episodes.max_episode_tokens=64"]  # and the teacher's block leave 64 of its 512 positions
    main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir), *extra])
    versions = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    assert versions, "no run folder written"
    run = versions[0]
    with open(os.path.join(run, "metrics.csv")) as f:
        header = f.readline()
    assert "train/reward" in header and "val/" in header
    assert os.path.isfile(os.path.join(run, "adapter", "final", "adapter_config.json"))
    assert glob.glob(os.path.join(run, "checkpoints", "*.ckpt"))


@pytest.mark.parametrize("ablation", ABLATIONS, ids=os.path.basename)
def test_ablation_layered_over_the_paper_config_runs_two_steps(ablation, tiny_model_dir, tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    main(["fit", f"--config={BASE}", f"--config={ablation}", *_tiny_args(tiny_model_dir)])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))["model"]["objective"]
    wanted = yaml.safe_load(open(ablation))["model"]["objective"]
    assert saved["class_path"] == wanted["class_path"]
    for key, value in wanted["init_args"].items():  # the ablation's values reached the objective
        assert saved["init_args"][key] == value, key


def test_reinforce_pp_layer_runs_with_its_scoring_pass(tiny_model_dir, tmp_path, monkeypatch):
    """The REINFORCE++ method layer over a task config: its KL needs the scoring pass every step, and its
    per-token advantages are logged."""
    monkeypatch.chdir(tmp_path)
    layer = os.path.join(os.path.dirname(BASE), "replication", "reinforce_pp.yaml")
    main(["fit", f"--config={BASE}", f"--config={layer}", *_tiny_args(tiny_model_dir)])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["time/scoring_s"]) > 0
        assert "train/kl" in row  # the reward's KL, every step (NaN where no row entered the loss)
    assert any(float(row["train/kl"]) == float(row["train/kl"]) for row in rows) or all(
        float(row["train/advantage_abs"]) == 0 for row in rows)



def test_gspo_by_class_path_trains_with_two_passes_and_its_ratios_move_in_the_second(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """GSPO from YAML (``scgrpo.objectives.GSPO``): with mu = 2, the second pass's sequence ratios are no longer 1,
    so a wide learning rate makes some rows clip (a step's clip fraction over both passes above 0)."""
    monkeypatch.chdir(tmp_path)
    main(["fit", f"--config={BASE}", *_tiny_args(tiny_model_dir), "--model.objective=scgrpo.objectives.GSPO",
          "--model.objective.init_args.num_iterations=2", "--model.optimizer.init_args.lr=0.05",
          "--model.verifier=tests.verifiers.helpers.ParityVerifier"])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    import yaml

    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["model"]["objective"]["class_path"] == "scgrpo.objectives.GSPO"
    assert saved["model"]["objective"]["init_args"]["eps_low"] == 3e-4
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == 1 and float(rows[0]["train/clip_fraction"]) > 0  # (max_steps 2: one batch, its 2 passes)


def test_scgrpo_run_logs_every_credit_key_every_step(tiny_model_dir, tmp_path, monkeypatch):
    import csv

    monkeypatch.chdir(tmp_path)
    main(["fit", f"--config={BASE}", *_tiny_args(tiny_model_dir), "--trainer.max_steps=3"])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    rows = [r for r in csv.DictReader(open(os.path.join(run, "metrics.csv"))) if r.get("train/reward")]
    assert len(rows) == 3
    for row in rows:
        for key in CREDIT_KEYS:
            assert key in row and row[key] != "", key
        shares = sum(float(row[f"credit/route_{r}"]) for r in ("partial", "solve_none", "single", "all"))
        assert shares == pytest.approx(1.0)
        assert float(row["policy/entropy"]) > 0
    with_teacher = [r for r in rows if float(r["credit/teacher_rows"]) > 0]
    assert with_teacher  # the random model's coin-flip-like parity rewards give mixed and solve-none groups
    for row in with_teacher:  # then every statistic of the active tokens is a number
        c, p75 = float(row["credit/c"]), float(row["credit/kl_p75"])
        assert c == max(p75, 1e-4) or c == pytest.approx(max(p75, 1e-4))
        assert 0 <= float(row["credit/f_mean"]) < 1 and 0 <= float(row["credit/f_above_half"]) <= 0.5
        assert float(row["credit/kl_p25"]) <= float(row["credit/kl_p50"]) <= p75 <= float(row["credit/kl_p95"])


def test_custom_verifier_by_class_path(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
    main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir),
          "--model.verifier=tests.verifiers.helpers.ParityVerifier", "--model.verifier.offset=1"])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    import yaml

    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["model"]["verifier"]["class_path"] == "tests.verifiers.helpers.ParityVerifier"
    assert saved["model"]["verifier"]["init_args"]["offset"] == 1


def test_custom_environment_by_class_path(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
    main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir),
          "--model.environment=tests.envs.scripted.Scripted", "--model.environment.turns=2",
          "--model.episodes.max_turns=3", "--model.episodes.max_episode_tokens=40"])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    import yaml

    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["model"]["environment"]["class_path"] == "tests.envs.scripted.Scripted"
    assert saved["model"]["episodes"]["max_episode_tokens"] == 40
    rows = [r for r in csv.DictReader(open(os.path.join(run, "metrics.csv"))) if r.get("episode/turns_mean")]
    assert len(rows) == 2 and all(float(r["episode/turns_mean"]) == 2.0 for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data.source=arithmetik"], "unknown task 'arithmetik'"),
        (["--model.episodes.max_turns=0"], "max_turns"),
        (["--model.generation.num_generations=1"], "num_generations"),
        (["--model.model=/does/not/exist"], "does not exist"),
        (["--model.objective.init_args.aggregation=sum"], "aggregation"),
        (["--model.quantization=int3"], "quantization='int3'"),
        (["--model.quantization=nf4", "--model.lora=null"], "cannot be trained"),
        (["--model.objective=scgrpo.objectives.SCGRPO", "--model.objective.init_args.w_max=5"], "c_quantile"),
    ],
)
def test_bad_config_values_end_in_one_clear_message(args, message, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
    with pytest.raises((SystemExit, ValueError, FileNotFoundError)) as info:
        main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir), *args])
    text = str(info.value) + capsys.readouterr().err
    assert message in text


def test_arith_configs_differ_only_in_the_objective_block():
    import yaml

    folder = os.path.join(os.path.dirname(__file__), "..", "configs")
    loaded = {n: yaml.safe_load(open(os.path.join(folder, f"{n}_arith.yaml"))) for n in
              ("scgrpo", "grpo", "drgrpo", "dapo", "selfdistill", "opsd")}
    for config in loaded.values():
        config["model"].pop("objective")
    first = loaded.pop("scgrpo")
    assert all(config == first for config in loaded.values())


def _the_error_line(stderr: str) -> str:
    """The one ``scgrpo: error:`` line of a failed run's stderr (and no traceback)."""
    lines = [line for line in stderr.splitlines() if line.startswith("scgrpo: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("fault", BAD_FILES)
def test_a_malformed_data_file_ends_the_run_in_one_line_naming_it(fault, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write_bad_file(tmp_path, fault)
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), "--model.validate_before_training=false",
              "--data.source=scgrpo.data.FileSource", f"--data.source.files={path}", "--data.eval_splits=[]"])
    assert info.value.code == 2
    assert _the_error_line(capsys.readouterr().err).startswith(f"scgrpo: error: {path}: {BAD_FILES[fault]}")


def test_a_model_folder_with_an_empty_config_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("")
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", f"--model.model={tmp_path / 'model'}", "--trainer.accelerator=cpu"])
    assert info.value.code == 2
    line = _the_error_line(capsys.readouterr().err)
    assert line == f"scgrpo: error: {tmp_path / 'model' / 'config.json'}: the file is empty; expected a Hugging Face model's config (model_type, ...)"


def test_a_file_named_runs_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("not a folder")
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir)])
    assert info.value.code == 2
    assert _the_error_line(capsys.readouterr().err).startswith(f"scgrpo: error: {tmp_path / 'runs'} is a file")


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--data.batch_size=abc", 'Parser key "data.batch_size": Expected a <class \'int\'>. Got value: abc'),
        ("--model.objective.init_args.c_quantile=2", "c_quantile must be in (0, 1), got 2.0"),
    ],
)
def test_a_config_error_prints_the_error_not_the_usage(arg, message, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), arg])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert _the_error_line(err) == f"scgrpo: error: {message}"
    assert "usage:" not in err and len(err.strip().splitlines()) <= 2


@pytest.mark.parametrize("given, suggested", [
    (["--model.generaton.max_new_tokens=4"], "did you mean --model.generation.max_new_tokens or "),
    ("yaml:model:\n  generation:\n    max_new_token: 4\n", "did you mean --model.generation.max_new_tokens or "),
    ("yaml:data:\n  batchsize: 4\n", "did you mean --data.batch_size or --data.eval_batch_size?"),
    (["--model.nothing_like_any_key=1"], None),
], ids=["argument", "yaml", "yaml-data", "far-from-every-key"])
def test_a_misspelled_key_is_answered_with_the_keys_it_is_close_to(given, suggested, tiny_model_dir, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if isinstance(given, str):
        (tmp_path / "typo.yaml").write_text(given.removeprefix("yaml:"))
        given = ["--config=typo.yaml"]
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), *given])
    assert info.value.code == 2
    line = _the_error_line(capsys.readouterr().err)
    if suggested is None:
        assert "did you mean" not in line and "nothing_like_any_key" in line
    else:
        assert suggested in line, line


def test_the_progress_bar_counts_steps_of_max_steps(tiny_model_dir, tmp_path, monkeypatch):
    """Lightning's bar on the endless prompt stream read "Epoch 0/-2" and, resumed at step 5 of 10, "10/5"."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar

    from scgrpo import PromptDataModule, RLVRModule
    from scgrpo.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar
    from scgrpo.cli import ScgrpoCLI

    resumed = SimpleNamespace(max_steps=10, max_epochs=-1, num_training_batches=float("inf"), global_step=5)
    lightning, ours = RichProgressBar(), StepRichProgressBar()
    lightning._trainer = ours._trainer = resumed
    assert lightning.total_train_batches == 5 and lightning._get_train_description(0).startswith("Epoch 0/-2")
    assert ours.total_train_batches == 10 and ours._get_train_description(0).strip() == "Step"
    finite = SimpleNamespace(max_steps=-1, max_epochs=3, num_training_batches=7, global_step=0)
    ours._trainer = finite  # a finite loader keeps Lightning's epochs
    assert ours.total_train_batches == 7 and ours._get_train_description(0).startswith("Epoch 0/2")

    monkeypatch.chdir(tmp_path)
    cli = ScgrpoCLI(RLVRModule, PromptDataModule, run=False, args=[
        f"--config={QUICKSTART}", f"--model.model={tiny_model_dir}", "--trainer.enable_progress_bar=true"])
    assert isinstance(cli.trainer.progress_bar_callback, (StepRichProgressBar, StepTQDMProgressBar))


def test_a_bad_checkpoint_mode_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), "--checkpoint.mode=maximum"])
    assert info.value.code == 2
    line = _the_error_line(capsys.readouterr().err)
    assert "checkpoint.mode" in line and "maximum" in line, line


def test_a_checkpoint_monitor_the_run_never_logs_is_one_line_before_training(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), "--model.eval_samples=2",
              "--checkpoint.monitor=val/id/avg@4"])
    assert info.value.code == 2
    line = _the_error_line(capsys.readouterr().err)
    assert line == ("scgrpo: error: checkpoint.monitor='val/id/avg@4' is not a metric this run logs; its validation "
                    "metrics are val/id/avg@2, val/id/pass@2, val/id/completion_length, val/id/truncated, "
                    "val/id/greedy, val/id/time_s")
    assert not glob.glob(str(tmp_path / "runs" / "*" / "version_*" / "checkpoints" / "*.ckpt"))  # nothing trained


def test_predict_is_not_offered(capsys):
    """Lightning's predict loop needs a forward pass the policy does not have: the CLI offers fit, validate and test
    only, and ``predict`` is refused in one line instead of crashing inside Lightning."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    listed = capsys.readouterr().out
    assert "validate" in listed and "predict" not in listed
    with pytest.raises(SystemExit) as info:
        main(["predict"])
    assert info.value.code == 2
    assert "invalid choice: 'predict' (choose from 'fit', 'validate', 'test')" in capsys.readouterr().err


def test_the_credit_task_config_evaluates_id_on_the_way_and_ood_at_the_end(tiny_model_dir, tmp_path, monkeypatch):
    import csv

    monkeypatch.chdir(tmp_path)
    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    main(["fit", f"--config={root}/replication/doors_mixed.yaml", f"--config={root}/replication/scgrpo.yaml",
          *_tiny_args(tiny_model_dir), "--trainer.val_check_interval=1", "--model.episodes.max_episode_tokens=64",
          "--model.eval_samples=2", "--data.eval_batch_size=4", "--checkpoint.every_n_train_steps=1",
          "--data.source.init_args.shots=0"])  # (the tiny tokenizer spends a token a byte)
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    steps = {split: [int(float(r["val/global_step"])) for r in rows if r.get(f"val/{split}/avg@2")]
             for split in ("id", "ood")}
    assert steps == {"id": [0, 1, 2], "ood": [2]}


def test_a_checkpoint_monitor_on_a_final_split_is_one_line_before_training(tiny_model_dir, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), "--model.eval_samples=2",
              "--data.eval_splits=[id]", "--data.final_splits=[ood]", "--checkpoint.monitor=val/ood/avg@2"])
    assert info.value.code == 2
    line = _the_error_line(capsys.readouterr().err)
    assert line == ("scgrpo: error: checkpoint.monitor='val/ood/avg@2' is on a split of data.final_splits ['ood'], "
                    "evaluated at the fit's last step only: monitor a split evaluated on the way")
