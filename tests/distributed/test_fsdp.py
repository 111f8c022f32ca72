"""FSDP2 sharding: one step on 1 process vs 2 (same global batch, same rollouts) and a 2-process CLI run.

On CPU the ranks talk through gloo and compute in fp32, so the sharded gradients must match to float
rounding; the GPU variant (2+ GPUs, NCCL, bf16) runs only where the GPUs are.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

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
    one = _step(tmp_path, tiny_model_dir, 1, *args)
    two = _step(tmp_path, tiny_model_dir, 2, *args)
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


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _fit(tiny_model_dir, cwd, *extra: str, port: int | None = None) -> str:
    """``scgrpo fit`` from the FSDP config on 2 CPU processes (rendezvous on ``port`` when given); returns the
    run folder."""
    config = os.path.join(ROOT, "configs", "fsdp_scgrpo_arith.yaml")
    before = set(glob.glob(str(cwd / "runs" / "*" / "version_*")))
    result = subprocess.run(
        ["scgrpo", "fit", f"--config={config}", f"--model.model={tiny_model_dir}", "--model.dtype=float32",
         "--model.generation.max_new_tokens=6", "--model.generation.num_generations=4", "--model.eval_samples=2",
         "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.enable_progress_bar=false",
         "--data.batch_size=2", "--data.max_eval_prompts=4", "--model.verifier=tests.verifiers.helpers.ParityVerifier",
         *extra],
        cwd=cwd, env={**_env(), **({"MASTER_PORT": str(port)} if port else {})}, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = set(glob.glob(str(cwd / "runs" / "*" / "version_*"))) - before
    return run


@pytest.mark.skipif(shutil.which("scgrpo") is None, reason="the scgrpo console script is not installed")
def test_sharded_run_resumed_from_a_checkpoint_equals_an_uninterrupted_one(tiny_model_dir, tmp_path):
    """4 steps == 2 steps + checkpoint + 2 resumed steps on 2 ranks: LoRA weights (gathered from shards),
    every rank's sampling generator and the verified buffer of both ranks come back. The 2-step run's
    checkpoint and exported adapter hold only whole LoRA tensors, and its buffer both ranks' prompts."""
    quiet = ["--model.validate_before_training=false", "--trainer.val_check_interval=2"]  # checkpoint every 2
    (tmp_path / "straight").mkdir()
    (tmp_path / "first").mkdir()
    ports = _free_ports(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two independent runs side by side (startup overlaps)
        straight_run = pool.submit(_fit, tiny_model_dir, tmp_path / "straight", "--trainer.max_steps=4", *quiet,
                                   port=ports[0])
        first_run = pool.submit(_fit, tiny_model_dir, tmp_path / "first", "--trainer.max_steps=2", *quiet,
                                port=ports[1])
        straight, first = straight_run.result(), first_run.result()
    (ckpt,) = glob.glob(os.path.join(first, "checkpoints", "*.ckpt"))
    _check_lora_only_checkpoint(tiny_model_dir, first, ckpt)
    resumed = _fit(tiny_model_dir, tmp_path, "--trainer.max_steps=4", f"--ckpt_path={ckpt}", *quiet)
    (a,) = glob.glob(os.path.join(straight, "checkpoints", "*.ckpt"))
    (b,) = glob.glob(os.path.join(resumed, "checkpoints", "*.ckpt"))
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert a["global_step"] == b["global_step"] == 4
    assert set(a["state_dict"]) == set(b["state_dict"])
    for name, tensor in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    assert a["PromptDataModule"] == b["PromptDataModule"]


def _check_lora_only_checkpoint(tiny_model_dir, run: str, ckpt: str) -> None:
    """Each rank fills the verified buffer from its own prompts and the checkpoint keeps both ranks'; the
    checkpoint holds exactly the LoRA tensors, whole, equal to the exported adapter."""
    checkpoint = torch.load(ckpt, weights_only=True)
    state = checkpoint["state_dict"]
    # one rank sees 2 steps x 2 prompts; about 94% of prompts get a verified completion (G=4, p=1/2)
    buffered = {pid for pid, _ in checkpoint["PromptDataModule"]["verified_buffer"]["entries"]}
    assert len(buffered) > 4, buffered

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
