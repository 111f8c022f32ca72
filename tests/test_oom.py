"""The GPU running out of memory in any phase of a run ends it in one ``scgrpo: error:`` line naming the phase and
the setting to change, with the last whole step's checkpoint intact and resumable. The allocator's failure is
simulated on the CPU: the phase's function raises what PyTorch raises."""

import gc
import glob
import weakref
from types import SimpleNamespace

import pytest
import torch

from scgrpo.policy import Policy
from scgrpo.stage import RolloutStage
from scgrpo.cli import main
from scgrpo.errors import GPUOutOfMemory
from scgrpo.evaluation import Evaluation
from scgrpo.module import RLVRModule
from scgrpo.oom import out_of_memory_as_error, out_of_memory_message
from scgrpo.update import PolicyUpdate
from tests.test_cli_configs import QUICKSTART, _the_error_line, _tiny_args

FAILED = "CUDA out of memory. Tried to allocate 2.00 GiB"
FAILING_STEP = 2  # the allocator fails in the third step (two whole steps before it)
SMALLER_UPDATE = "lower model.memory_budget_gib or model.micro_batch_size, or set model.gradient_checkpointing: true"
SMALLER_FORWARD = "lower model.memory_budget_gib or model.micro_batch_size"  # (checkpointing: only the update)


# ------------------------------------------------------------------------------------------ the message
def _card(monkeypatch, allocated: float, reserved: float, free: float, total: float) -> list[str]:
    """A CUDA card as ``torch.cuda`` reports it (GiB); returns the calls to ``empty_cache``."""
    gib, emptied = 2**30, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free * gib), int(total * gib)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(allocated * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("empty_cache"))
    return emptied


def _module(**settings) -> SimpleNamespace:
    defaults = dict(memory_budget_gib=None, micro_batch_size=None, gradient_checkpointing=False,
                    device=torch.device("cpu"), global_step=0)
    return SimpleNamespace(**{**defaults, **settings})


@pytest.mark.parametrize("phase, settings", [
    ("rollout", "lower model.memory_budget_gib or model.generation.max_slots"),
    ("validation", "lower model.memory_budget_gib or model.generation.max_slots"),
    ("scoring", SMALLER_FORWARD),
    ("teacher", SMALLER_FORWARD),
    ("update", SMALLER_UPDATE),
])
def test_the_message_names_the_phase_the_memory_and_the_settings_of_the_phase(phase, settings, monkeypatch):
    _card(monkeypatch, allocated=21.4, reserved=21.9, free=0.3, total=22.5)
    assert out_of_memory_message(phase, _module(memory_budget_gib=22.0)) == (
        f"out of GPU memory in the {phase} phase (budget 22.0 GiB; 21.4 GiB allocated, 21.9 GiB reserved, 0.3 of "
        f"22.5 GiB free on the card): {settings}")


def test_without_a_budget_or_cuda_the_message_says_the_card_s_free_memory_and_leaves_out_settings_already_made(
        monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert out_of_memory_message("update", _module(gradient_checkpointing=True)) == (
        "out of GPU memory in the update phase (budget: the card's free memory): set model.memory_budget_gib below "
        "the card's free memory or lower model.micro_batch_size")
    assert out_of_memory_message("teacher", _module(gradient_checkpointing=True, micro_batch_size=1)) == (
        "out of GPU memory in the teacher phase (budget: the card's free memory): set model.memory_budget_gib below "
        "the card's free memory")
    on = _module(gradient_checkpointing=None, actor=SimpleNamespace(checkpointing=True))  # the budget switched it on
    assert out_of_memory_message("update", on).endswith(": set model.memory_budget_gib below the card's free memory or "
                                                         "lower model.micro_batch_size")
    assert out_of_memory_message("rollout", _module()).endswith(
        ": set model.memory_budget_gib below the card's free memory or lower model.generation.max_slots")


def test_the_budget_the_run_resolved_is_named_as_the_default(monkeypatch):
    _card(monkeypatch, allocated=18.0, reserved=19.5, free=0.3, total=20.5)
    module = _module(budget=SimpleNamespace(gib_resolved=20.9))  # no budget set: the default the run read from the card
    assert out_of_memory_message("teacher", module).startswith(
        "out of GPU memory in the teacher phase (budget 20.9 GiB (the default); 18.0 GiB allocated")
    assert out_of_memory_message("teacher", module).endswith(": lower model.memory_budget_gib or model.micro_batch_size")


def test_memory_held_by_another_process_is_named(monkeypatch):
    _card(monkeypatch, allocated=21.4, reserved=21.9, free=0.3, total=79.1)
    assert out_of_memory_message("update", _module(memory_budget_gib=22.0)) == (
        "out of GPU memory in the update phase (budget 22.0 GiB; 21.4 GiB allocated, 21.9 GiB reserved, 0.3 of "
        f"79.1 GiB free on the card): 56.9 GiB of the card are held by another process: free it, or {SMALLER_UPDATE}")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError(FAILED), RuntimeError(f"{FAILED} (GPU 0; 79.1 GiB)"),
                                   RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")])
def test_a_failed_allocation_becomes_one_error_after_the_phase_s_memory_is_released(error, monkeypatch):
    emptied = _card(monkeypatch, allocated=1.0, reserved=2.0, free=0.5, total=2.5)
    held = []

    def phase():
        activations = torch.ones(4)  # what a failed phase's frame holds until its traceback goes
        held.append(weakref.ref(activations))
        raise error

    with pytest.raises(GPUOutOfMemory, match="in the teacher phase") as info:
        with out_of_memory_as_error("teacher", _module()):
            phase()
    gc.collect()
    assert info.value.__cause__ is error and held[0]() is None and emptied == ["empty_cache"]


def test_other_errors_pass_as_they_are():
    error = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as info, out_of_memory_as_error("update", _module()):
        raise error
    assert info.value is error
    with pytest.raises(ValueError, match="phase must be one of"), out_of_memory_as_error("sampling", _module()):
        pass


# ------------------------------------------------------------------------------------------ in a run
def _trainable(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


@pytest.fixture
def steps(monkeypatch):
    """The trainable weights after each whole step, by step, and at each training start (``"start"``)."""
    seen: dict = {"start": []}
    step_end, train_start = RLVRModule.on_train_batch_end, RLVRModule.on_train_start

    def after_step(self, *args):
        step_end(self, *args)
        seen[self.global_step] = _trainable(self)
        seen[f"extra_consumed {self.global_step}"] = self.trainer.datamodule.extra_consumed

    def at_start(self):
        seen["start"].append(_trainable(self))
        train_start(self)

    monkeypatch.setattr(RLVRModule, "on_train_batch_end", after_step)
    monkeypatch.setattr(RLVRModule, "on_train_start", at_start)
    return seen


def _fail_in(phase: str, patch, after: int = FAILING_STEP) -> None:
    """Makes ``phase`` of the step after ``after`` whole ones fail as the allocator would."""

    def fails(global_step: int) -> None:
        if global_step == after:
            raise torch.OutOfMemoryError(FAILED)

    # the phases entered through a call made once a step: that call fails first (rollout, scoring: counted calls)
    entries = {"rollout": (RolloutStage, "sample"), "scoring": (Policy, "score")}
    if phase in entries:
        owner, name = entries[phase]
        original, calls = getattr(owner, name), []

        def counted(self, *args, **kwargs):
            calls.append(1)
            fails(len(calls) - 1)
            return original(self, *args, **kwargs)

        patch.setattr(owner, name, counted)
    elif phase == "teacher":
        original = RLVRModule.run_self_teacher
        patch.setattr(RLVRModule, "run_self_teacher", lambda module, data: fails(module.global_step) or original(module, data))
    elif phase == "update":
        accumulate = PolicyUpdate.accumulate

        def after_backward(self, rollouts, plan, sums, step=0):
            accumulate(self, rollouts, plan, sums, step)  # every micro-batch's forward and backward
            if step == after:  # gradients that an optimiser step would apply, and the failure before it
                for p in self.policy.trainable_parameters():
                    p.grad = torch.ones_like(p) if p.grad is None else p.grad + 1
                fails(step)

        patch.setattr(PolicyUpdate, "accumulate", after_backward)
    else:
        add, validation_step, now = Evaluation.add, RLVRModule.validation_step, {}

        def validating(module, *args, **kwargs):  # (the evaluation is handed the policy: the step from here)
            now["step"] = module.global_step
            return validation_step(module, *args, **kwargs)

        patch.setattr(RLVRModule, "validation_step", validating)
        patch.setattr(Evaluation, "add", lambda self, batch, *args: fails(now["step"]) or add(self, batch, *args))


SMALLER_ROLLOUT = "set model.memory_budget_gib below the card's free memory or lower model.generation.max_slots"
SMALLER_PASSES = "set model.memory_budget_gib below the card's free memory or lower model.micro_batch_size"
SMALLER_UPDATE_PASSES = ("set model.memory_budget_gib below the card's free memory, lower model.micro_batch_size or "
                         "set model.gradient_checkpointing: true")
PHASES = {  # the phase, the run's settings (the quickstart's SC-GRPO: a teacher pass) and the settings named
    "rollout": ([], SMALLER_ROLLOUT),
    "scoring": (["--model.objective=scgrpo.objectives.GRPO", "--model.objective.init_args.beta=0.05"], SMALLER_PASSES),
    "teacher": ([], SMALLER_PASSES),
    "update": (["--model.micro_batch_size=2"], SMALLER_UPDATE_PASSES),
    "validation": (["--trainer.val_check_interval=2", "--model.eval_greedy=false", "--data.max_eval_prompts=2"],
                   SMALLER_ROLLOUT),
}


def _run(tiny_model_dir, *args) -> None:
    """``scgrpo fit`` of the quickstart's SC-GRPO on the tiny model, rewarded by a verifier it can satisfy."""
    main(["fit", f"--config={QUICKSTART}", *_tiny_args(tiny_model_dir), "--trainer.max_steps=4",
          "--trainer.val_check_interval=100", "--model.validate_before_training=false",
          "--model.log_completions_every_n_steps=0", "--model.verifier=tests.verifiers.helpers.ParityVerifier", *args])


@pytest.mark.parametrize("phase", PHASES)
def test_out_of_memory_in_a_phase_is_one_line_and_the_last_checkpoint_is_the_last_whole_step(
        phase, tiny_model_dir, tmp_path, monkeypatch, capsys, steps):
    monkeypatch.chdir(tmp_path)
    settings, named = PHASES[phase]
    with monkeypatch.context() as patch, pytest.raises(SystemExit) as info:
        _fail_in(phase, patch)
        _run(tiny_model_dir, "--checkpoint.every_n_train_steps=1", *settings)
    assert info.value.code == 2
    line = _the_error_line(capsys.readouterr().err)
    assert line == (f"scgrpo: error: out of GPU memory in the {phase} phase (budget: the card's free memory): {named}; "
                    "the last checkpoint is kept")

    (last,) = glob.glob(str(tmp_path / "runs" / "*" / "version_0" / "checkpoints" / "last.ckpt"))
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == FAILING_STEP and checkpoint["PromptDataModule"]["batches_consumed"] == 2
    whole, untrained = steps[FAILING_STEP], steps["start"][0]
    assert set(checkpoint["state_dict"]) == set(whole)
    assert any(not torch.equal(untrained[name], value) for name, value in whole.items())  # (two steps trained)
    for name, value in whole.items():
        assert torch.equal(checkpoint["state_dict"][name], value), name

    _run(tiny_model_dir, "--checkpoint.every_n_train_steps=1", *settings, "--trainer.max_steps=3",
         f"--ckpt_path={last}")  # resumes, and trains on
    for name, value in whole.items():
        assert torch.equal(steps["start"][-1][name], value), name
    assert torch.load(last, weights_only=False)["global_step"] == 3 and 3 in steps


@pytest.mark.parametrize("phase", PHASES)
def test_with_scgrpo_debug_the_error_is_raised_with_the_original_as_its_cause(phase, tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCGRPO_DEBUG", "1")
    with monkeypatch.context() as patch, pytest.raises(GPUOutOfMemory, match=f"in the {phase} phase") as info:
        _fail_in(phase, patch, after=0)  # in the first step (validation: the one before training)
        _run(tiny_model_dir, *PHASES[phase][0], "--model.validate_before_training=true")
    assert type(info.value.__cause__) is torch.OutOfMemoryError and str(info.value.__cause__) == FAILED


def test_the_checkpoint_written_on_the_error_holds_the_last_whole_step(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                      steps):
    """With no periodic checkpoint at the step before, the one written on the error is that step's: its weights
    (the failed update's gradients never applied) and its data position, DAPO's extra prompts included (every
    group of an always-right verifier has equal rewards: each step samples its extra rounds before the update)."""
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as patch, pytest.raises(SystemExit):
        _fail_in("update", patch)
        _run(tiny_model_dir, "--checkpoint.every_n_train_steps=100", "--model.objective=scgrpo.objectives.DAPO",
             "--model.objective.init_args.max_sampling_rounds=2",
             "--model.verifier=tests.verifiers.helpers.AlwaysRight")
    assert "in the update phase" in _the_error_line(capsys.readouterr().err)
    (last,) = glob.glob(str(tmp_path / "runs" / "*" / "version_0" / "checkpoints" / "last.ckpt"))
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == FAILING_STEP
    assert checkpoint["PromptDataModule"]["extra_consumed"] == steps[f"extra_consumed {FAILING_STEP}"] == 4
    for name, value in steps[FAILING_STEP].items():
        assert torch.equal(checkpoint["state_dict"][name], value), name


def test_out_of_memory_between_the_optimiser_steps_of_a_batch_leaves_no_half_updated_checkpoint(
        tiny_model_dir, tmp_path, monkeypatch, capsys, steps):
    """GRPO with two passes over each batch takes two optimiser steps a batch. Failing in the second pass of the
    third batch (optimiser step 5), after the first pass moved the weights, no checkpoint is written on the error:
    ``last.ckpt`` stays the second batch's (step 4)."""
    monkeypatch.chdir(tmp_path)
    accumulate = PolicyUpdate.accumulate

    def second_pass_fails(self, rollouts, plan, sums, step=0):
        if step == 5:
            raise torch.OutOfMemoryError(FAILED)
        accumulate(self, rollouts, plan, sums, step)

    with monkeypatch.context() as patch, pytest.raises(SystemExit):
        patch.setattr(PolicyUpdate, "accumulate", second_pass_fails)
        _run(tiny_model_dir, "--checkpoint.every_n_train_steps=1", "--model.objective=scgrpo.objectives.GRPO",
             "--model.objective.init_args.num_iterations=2", "--trainer.max_steps=8")
    assert "in the update phase" in _the_error_line(capsys.readouterr().err)
    (last,) = glob.glob(str(tmp_path / "runs" / "*" / "version_0" / "checkpoints" / "last.ckpt"))
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == 4 and checkpoint["PromptDataModule"]["batches_consumed"] == 2
    for name, value in steps[4].items():
        assert torch.equal(checkpoint["state_dict"][name], value), name
