"""FSDP2 sharding: one step on 1 process vs 2 (same global batch, same rollouts) and a 2-process CLI run.

On CPU the ranks talk through gloo and compute in fp32, so the sharded gradients must match to float
rounding; the GPU variant (2+ GPUs, NCCL, bf16) runs only where the GPUs are.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CHECK = os.path.join(ROOT, "scripts", "fsdp_step_check.py")


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None) if torch.cuda.device_count() > 1 else env.update(CUDA_VISIBLE_DEVICES="")
    return env


def _step(tmp_path, model_dir, nproc: int, *args: str) -> dict:
    out = tmp_path / f"grads-{nproc}.pt"
    launch = [sys.executable, CHECK] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", CHECK]
    result = subprocess.run([*launch, f"--model={model_dir}", f"--out={out}", *args], env=_env(),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out)


def _step_check():
    spec = importlib.util.spec_from_file_location("fsdp_step_check", CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def _forked_rank(rank: int, world: int, port: int, argv: list[str]) -> None:
    torch.set_num_threads(1)  # a forked child starts no thread pool of its own (a tiny model: none is needed)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    _step_check().main(argv)


def _cpu_step(tmp_path, model_dir, nproc: int, *args: str) -> dict:
    """The step check on CPU without fresh interpreters (each would spend seconds importing torch, Lightning
    and Transformers): one process runs here, with no process group; the ranks of several are forked from
    here and meet over gloo exactly as torchrun's would (the script reads the same variables)."""
    out = tmp_path / f"grads-{nproc}.pt"
    argv = [f"--model={model_dir}", f"--out={out}", "--device=cpu", *args]
    if nproc == 1:
        _step_check().main(argv)
    else:
        for attempt in range(PORT_ATTEMPTS):
            try:
                _run_ranks(nproc, argv)
                break
            except mp.ProcessRaisedException as err:  # the port picked was taken before rank 0 bound it: another
                if "address already in use" not in str(err).lower() or attempt == PORT_ATTEMPTS - 1:
                    raise
    return torch.load(out)


PORT_ATTEMPTS = 3
"""Launches of forked ranks, each on a port free when picked (another process may bind it before rank 0 does)."""


def _run_ranks(nproc: int, argv: list[str]) -> None:
    # forked, unless this process has used CUDA: its backward passes then started autograd's device threads, which
    # a forked child cannot use (on a GPU machine, after the GPU tests); spawned ranks import everything anew
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    ranks = mp.start_processes(_forked_rank, args=(nproc, _free_port(), argv), nprocs=nproc, join=False,
                               start_method=method)
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=1):  # raises if a rank fails (the others are ended then)
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the ranks did not finish within 180 s")


def _compare(one: dict, two: dict, rtol: float, atol: float) -> None:
    assert one["world"] == 1 and two["world"] == 2
    assert set(one["grads"]) == set(two["grads"]) and len(one["grads"]) > 0
    assert abs(one["loss"] - two["loss"]) <= atol + rtol * abs(one["loss"])
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=rtol, atol=atol, msg=name)
    assert any(g.abs().max() > 0 for g in one["grads"].values())


def test_sharded_step_equals_single_process_step_on_cpu(tiny_model_dir, tmp_path):
    """GRPO and SC-GRPO (one process each side). 6 prompts: rank 0 gets a partial-solve, a solve-none and a
    partial-solve group, rank 1 an all-correct, a partial-solve and a solve-none one, so SC-GRPO's c and the
    loss denominators must be global; with micro-batches of 3 rows the ranks run different numbers of passes
    and rank 1 pads with zero-weight passes to keep FSDP's collectives paired."""
    args = ("--objective=grpo,scgrpo", "--prompts=6", "--micro-batch-size=3")
    one = _cpu_step(tmp_path, tiny_model_dir, 1, *args)
    two = _cpu_step(tmp_path, tiny_model_dir, 2, *args)
    for name in ("grpo", "scgrpo"):
        _compare({"world": one["world"], **one["results"][name]}, {"world": two["world"], **two["results"][name]},
                 rtol=1e-4, atol=1e-6)


def _relative_error(grads: dict, reference: dict) -> float:
    """||g - g_ref|| / ||g_ref|| over all LoRA gradients together."""
    diff = sum(float((grads[k] - reference[k]).pow(2).sum()) for k in reference)
    return (diff / sum(float(v.pow(2).sum()) for v in reference.values())) ** 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("objective", ["grpo", "scgrpo"])
def test_sharded_step_equals_single_gpu_step_in_bf16(tiny_model_dir, tmp_path, objective):
    """bf16 tolerance, measured rather than guessed: the fp32 single-GPU step is the reference, and the
    2-GPU bf16 step may differ from it by at most about what the 1-GPU bf16 step itself differs."""
    args = (f"--objective={objective}", "--prompts=16", "--completion-len=32")
    exact = _step(tmp_path, tiny_model_dir, 1, *args, "--dtype=float32")
    one = _step(tmp_path, tiny_model_dir, 1, *args, "--dtype=bfloat16")
    (tmp_path / "grads-1.pt").unlink()
    two = _step(tmp_path, tiny_model_dir, 2, *args, "--dtype=bfloat16")
    floor, sharded = _relative_error(one["grads"], exact["grads"]), _relative_error(two["grads"], exact["grads"])
    print(f"{objective}: relative gradient error vs fp32: 1 GPU bf16 {floor:.4f}, 2 GPUs bf16 {sharded:.4f}; "
          f"loss fp32 {exact['loss']:.6f}, 1 GPU {one['loss']:.6f}, 2 GPUs {two['loss']:.6f}")
    assert floor < 0.1  # the reference itself is sound
    assert sharded <= 2 * floor + 0.01
    assert abs(two["loss"] - exact["loss"]) <= 2 * abs(one["loss"] - exact["loss"]) + 1e-3 * abs(exact["loss"]) + 1e-4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fit(tiny_model_dir, cwd, *extra: str, torchrun: bool = False) -> str:
    """``scgrpo fit`` from the FSDP config on 2 CPU processes, the second started by Lightning, or both by
    torchrun (importing side by side); returns the run folder."""
    config = os.path.join(ROOT, "configs", "fsdp_scgrpo_arith.yaml")
    before = set(glob.glob(str(cwd / "runs" / "*" / "version_*")))
    launch = ["scgrpo"] if not torchrun else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "scgrpo.cli"]
    result = subprocess.run(
        [*launch, "fit", f"--config={config}", f"--model.model={tiny_model_dir}", "--model.dtype=float32",
         "--model.generation.max_new_tokens=6", "--model.generation.num_generations=4", "--model.eval_samples=2",
         "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.enable_progress_bar=false",
         "--data.batch_size=2", "--data.max_eval_prompts=4", "--model.verifier=tests.verifiers.helpers.ParityVerifier",
         *extra],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = set(glob.glob(str(cwd / "runs" / "*" / "version_*"))) - before
    return run


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("scgrpo") is None, reason="the scgrpo console script is not installed")
def test_sharded_run_resumed_from_a_checkpoint_equals_an_uninterrupted_one(tiny_model_dir, tmp_path):
    """4 steps == 2 steps + checkpoint + 2 resumed steps on 2 ranks: LoRA weights (gathered from shards),
    every rank's sampling generator and the verified buffer of both ranks come back. The uninterrupted run
    keeps its step-2 checkpoint too, which is what a run stopped after 2 steps leaves (the same state saved at
    the same point), and the resumed run starts from it. The checkpoints and the exported adapter hold only
    whole LoRA tensors, and the buffer both ranks' prompts. The uninterrupted run is launched as
    ``scgrpo fit`` (Lightning starts rank 1), the resumed one by torchrun, as a cluster job resumes."""
    quiet = ["--model.validate_before_training=false", "--trainer.val_check_interval=2",  # checkpoint every 2
             "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
             "--trainer.callbacks.save_top_k=-1"]  # ... and keep each one
    (tmp_path / "straight").mkdir()
    (tmp_path / "resumed").mkdir()
    straight = _fit(tiny_model_dir, tmp_path / "straight", "--trainer.max_steps=4", *quiet)
    checkpoints = {torch.load(c, weights_only=True)["global_step"]: c  # the added ModelCheckpoint's
                   for c in glob.glob(os.path.join(straight, "checkpoints", "epoch=*.ckpt"))}
    assert set(checkpoints) == {2, 4}
    _check_lora_only_checkpoint(tiny_model_dir, straight, checkpoints[4], checkpoints[2])
    # a checkpoint outside a run folder: the resumed run gets a folder of its own (from inside one it would
    # go on in the uninterrupted run's folder, over the checkpoints compared here)
    step_two = shutil.copy(checkpoints[2], tmp_path / "resumed" / "step-2.ckpt")
    resumed = _fit(tiny_model_dir, tmp_path / "resumed", "--trainer.max_steps=4",
                   f"--ckpt_path={step_two}", *quiet, torchrun=True)
    (b,) = glob.glob(os.path.join(resumed, "checkpoints", "epoch=*.ckpt"))
    a, b = torch.load(checkpoints[4], weights_only=True), torch.load(b, weights_only=True)
    assert a["global_step"] == b["global_step"] == 4
    assert set(a["state_dict"]) == set(b["state_dict"])
    for name, tensor in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    assert a["PromptDataModule"] == b["PromptDataModule"]


def _check_lora_only_checkpoint(tiny_model_dir, run: str, ckpt: str, ckpt_after_two: str) -> None:
    """Each rank fills the verified buffer from its own prompts and the checkpoint keeps both ranks'; the
    checkpoints hold exactly the LoRA tensors, the last one whole and equal to the exported adapter."""
    after_two = torch.load(ckpt_after_two, weights_only=True)
    # one rank sees 2 steps x 2 prompts; about 94% of prompts get a verified completion (G=4, p=1/2)
    buffered = {pid for pid, _ in after_two["PromptDataModule"]["verified_buffer"]["entries"]}
    assert len(buffered) > 4, buffered
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert {k: v.shape for k, v in after_two["state_dict"].items()} == {k: v.shape for k, v in state.items()}

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                         os.path.join(run, "adapter", "final"))
    lora_names = {n for n, _ in exported.named_parameters() if "lora_" in n}
    assert state and all("lora_" in k for k in state)  # no frozen weight in the checkpoint
    assert {k.removeprefix("runner.policy.") for k in state} == lora_names
    for name, p in exported.named_parameters():
        if "lora_" in name:  # whole tensors (gathered from the shards), equal to the checkpoint's
            torch.testing.assert_close(p.detach(), state[f"runner.policy.{name}"])
    with open(os.path.join(run, "metrics.csv")) as f:
        header = f.readline()
    assert "train/reward" in header and "time/teacher_s" in header and "credit/c" in header


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("scgrpo") is None, reason="the scgrpo console script is not installed")
def test_sharded_episodes_of_different_lengths_on_each_rank_train(tiny_model_dir, tmp_path):
    """Each turn's sampler gathers the sharded weights: a rank whose episodes ended keeps pace with the other."""
    run = _fit(tiny_model_dir, tmp_path, "--trainer.max_steps=2", "--trainer.val_check_interval=2",
               "--model.environment=tests.envs.scripted.Scripted", "--model.environment.turns=1",
               "--model.environment.more_turns_per_rank=2", "--model.episodes.max_turns=3",
               "--model.episodes.max_episode_tokens=120")
    import csv

    rows = [r for r in csv.DictReader(open(os.path.join(run, "metrics.csv"))) if r.get("episode/turns_mean")]
    assert len(rows) == 2
    assert all(float(r["episode/turns_mean"]) == 2.0 for r in rows)  # the mean over ranks of 1 and 3 turns
