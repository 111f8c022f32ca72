"""Several machines simulated on one CPU machine: 2 "nodes" x 1 process, each started by its own torchrun as a
cluster starts them (``--nnodes 2 --node_rank k``, one static rendezvous), each with its own model cache and scratch
folder, meeting over gloo. The GGUF conversion is stood in for by a copy (``nodes/sitecustomize.py``), so that each
node's cache can be counted."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NODES = os.path.join(os.path.dirname(__file__), "nodes")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_nodes(tmp_path, model_dir: str, cwds: list, *extra: str, gpu: bool = False,
                  launcher: str = "torchrun") -> list[subprocess.CompletedProcess]:
    """``scgrpo fit`` of the FSDP config on 2 nodes of 1 process; node k runs in ``cwds[k]`` with its own
    ``SCGRPO_CACHE`` and ``TMPDIR`` under ``tmp_path/node<k>``; with ``gpu``, on GPU k alone (NCCL), else on CPU
    (gloo). ``launcher``: "torchrun" (each node's own ``torchrun --nnodes 2 --node_rank k``) or "slurm" (the process
    started with the variables ``srun`` gives a task of a 2-node job, one task per node, which Lightning reads)."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # (converted by the stand-in)
    port, procs = _free_port(), []
    for node, cwd in enumerate(cwds):
        home = tmp_path / f"node{node}"
        for sub in ("cache", "tmp"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        path = [NODES, os.path.join(ROOT, "src"), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                   SCGRPO_CACHE=str(home / "cache"), TMPDIR=str(home / "tmp"), SCGRPO_TEST_NODE_DIR=str(home),
                   SCGRPO_TEST_GGUF_SOURCE=model_dir, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   CUDA_VISIBLE_DEVICES=str(node) if gpu else "")
        if launcher == "slurm":
            env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(node), SLURM_LOCALID="0",
                       SLURM_NODEID=str(node), SLURM_JOB_ID="4242", SLURM_JOB_NAME="scgrpo", SLURM_NNODES="2",
                       SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            launch = [sys.executable, "-m", "scgrpo.cli"]
        else:
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                      "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "scgrpo.cli"]
        command = [*launch, "fit",
                   f"--config={os.path.join(ROOT, 'configs', 'fsdp_scgrpo_arith.yaml')}", f"--model.model={gguf}",
                   "--model.dtype=float32", "--model.generation.max_new_tokens=6",
                   "--model.generation.num_generations=4", "--model.eval_samples=2",
                   "--model.validate_before_training=false", f"--trainer.accelerator={'gpu' if gpu else 'cpu'}",
                   "--trainer.num_nodes=2",
                   "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
                   "--trainer.enable_progress_bar=false", "--data.batch_size=2", "--data.max_eval_prompts=4",
                   "--model.verifier=tests.verifiers.helpers.ParityVerifier",
                   "--trainer.callbacks+=tests.distributed.nodes.dump.DumpWeights", *extra]
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _conversions(tmp_path, node: int) -> list[str]:
    path = tmp_path / f"node{node}" / "cache" / "conversions.log"
    return path.read_text().splitlines() if path.exists() else []


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (each simulated node takes one)")


@pytest.mark.parametrize("gpu, launcher", [(False, "torchrun"), (False, "slurm"), pytest.param(True, "torchrun",
                                                                                              marks=TWO_GPUS)],
                         ids=["cpu-torchrun", "cpu-slurm", "gpu-torchrun"])
def test_two_nodes_train_to_identical_weights_each_with_its_own_cache(tiny_model_dir, tmp_path, gpu, launcher):
    shared = tmp_path / "shared"  # the run folder's filesystem, mounted by both nodes
    shared.mkdir()
    results = _launch_nodes(tmp_path, tiny_model_dir, [shared, shared], gpu=gpu, launcher=launcher)
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n" + result.stdout[-3000:] + result.stderr[-3000:]
    first, second = (torch.load(tmp_path / f"node{k}" / "weights.pt", weights_only=True) for k in (0, 1))
    assert first and set(first) == set(second)
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
    lora = next(t for n, t in first.items() if "lora_B" in n)
    assert lora.abs().sum() > 0  # (trained: LoRA's B starts at zero)
    for node in (0, 1):  # each node converted the model into its own cache, once
        assert len(_conversions(tmp_path, node)) == 1
        (folder,) = [f for f in glob.glob(str(tmp_path / f"node{node}" / "cache" / "models" / "tiny-*"))
                     if os.path.isdir(f)]  # (beside it, the conversion's lock file)
        assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    (run,) = glob.glob(str(shared / "runs" / "*" / "version_*"))
    assert os.path.isfile(os.path.join(run, "metrics.csv")) and os.path.isdir(os.path.join(run, "adapter", "final"))
    assert not glob.glob(os.path.join(run, ".scgrpo-shared-*"))  # the start-up check's marker is gone


def test_a_run_folder_the_nodes_do_not_share_is_one_line_at_start(tiny_model_dir, tmp_path):
    apart = [tmp_path / "disk0", tmp_path / "disk1"]  # each node writes runs/ on its own disk
    for folder in apart:
        folder.mkdir()
    results = _launch_nodes(tmp_path, tiny_model_dir, apart)
    for result in results:
        assert result.returncode != 0
    lines = [line for r in results for line in r.stderr.splitlines() if line.startswith("scgrpo: error:")]
    assert lines and all("is not shared by every node: rank 1 on" in line for line in lines), lines
    for result in results:  # the process's own output is that line; torchrun then reports the exit code its way
        assert "Traceback" not in result.stderr.split("failed (exitcode: 2)")[0]
    assert not glob.glob(str(tmp_path / "node*" / "weights.pt"))  # stopped before training
