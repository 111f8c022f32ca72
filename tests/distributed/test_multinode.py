"""Several machines simulated on one machine: 2 "nodes" x 1 process, each started as a cluster starts it (its own
``torchrun --nnodes 2 --node_rank k``, one static rendezvous; or the variables ``srun`` gives a task), each with
its own scratch folder and model cache (or one cache both mount), meeting over gloo (NCCL on two GPUs). Reading the
GGUF file is stood in for (``nodes/sitecustomize.py``); the rest of its conversion into the cache is the package's,
and each conversion is counted. The weights both nodes end with are compared with one node of 2 processes
(``torchrun --nnodes 1 --nproc_per_node 2``) trained on the same global batch."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NODES = os.path.join(os.path.dirname(__file__), "nodes")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (each simulated node takes one)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fit_args(gguf, gpu: bool, nodes: int, devices: int) -> list[str]:
    return ["fit", f"--config={os.path.join(ROOT, 'configs', 'fsdp_scgrpo_arith.yaml')}", f"--model.model={gguf}",
            "--model.dtype=float32", "--model.generation.max_new_tokens=6", "--model.generation.num_generations=4",
            "--model.eval_samples=2", "--model.validate_before_training=false",
            f"--trainer.accelerator={'gpu' if gpu else 'cpu'}", f"--trainer.num_nodes={nodes}",
            f"--trainer.devices={devices}", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false", "--data.batch_size=2", "--data.max_eval_prompts=4",
            "--model.verifier=tests.verifiers.helpers.ParityVerifier",
            "--trainer.callbacks+=tests.distributed.nodes.dump.DumpWeights"]


def _env(home, model_dir: str, cache, gpus: str) -> dict:
    for sub in ("tmp", "cache"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    path = [NODES, os.path.join(ROOT, "src"), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), SCGRPO_CACHE=str(cache), TMPDIR=str(home / "tmp"),
               SCGRPO_TEST_NODE_DIR=str(home), SCGRPO_TEST_GGUF_SOURCE=model_dir,
               SCGRPO_TEST_CONVERSIONS=str(home / "conversions.log"), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES=gpus)
    if gpus:  # the two nodes on one host: NCCL as between machines (no shared memory, no peer-to-peer copies)
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    return env


def _run_all(commands: list[tuple[list[str], str, dict]], logs) -> list[tuple[int, str]]:
    """Starts every ``(command, cwd, env)`` at once and waits for all; (exit code, stderr) of each. Output goes to
    files (a full pipe would stall a node); on a timeout every process group is killed."""
    procs = []
    try:
        for k, (command, cwd, env) in enumerate(commands):
            with open(logs / f"out-{k}.txt", "w") as out, open(logs / f"err-{k}.txt", "w") as err:
                procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err,
                                              start_new_session=True))
        codes = [proc.wait(timeout=400) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return [(code, (logs / f"err-{k}.txt").read_text()) for k, code in enumerate(codes)]


def _launch_nodes(tmp_path, model_dir: str, cwds: list, gpu: bool = False, launcher: str = "torchrun",
                  shared_cache: bool = False) -> list[tuple[int, str]]:
    """``scgrpo fit`` of the FSDP config on 2 nodes of 1 process: node k runs in ``cwds[k]``, with its scratch folder
    and cache under ``tmp_path/node<k>`` (``shared_cache``: one cache for both); with ``gpu``, on GPU k alone."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # (read by the stand-in)
    port, commands = _free_port(), []
    for node, cwd in enumerate(cwds):
        home = tmp_path / f"node{node}"
        cache = tmp_path / "shared-cache" if shared_cache else home / "cache"
        env = _env(home, model_dir, cache, str(node) if gpu else "")
        if launcher == "slurm":
            env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(node), SLURM_LOCALID="0",
                       SLURM_NODEID=str(node), SLURM_JOB_ID="4242", SLURM_JOB_NAME="scgrpo", SLURM_NNODES="2",
                       SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            launch = [sys.executable, "-m", "scgrpo.cli"]
        else:
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                      "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "scgrpo.cli"]
        commands.append(([*launch, *_fit_args(gguf, gpu, nodes=2, devices=1)], cwd, env))
    return _run_all(commands, tmp_path)


def _one_node_of_two(tmp_path, model_dir: str, gpu: bool) -> dict:
    """The trainable weights after the same run on one node of 2 processes."""
    home, gguf = tmp_path / "one-node", tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    env = _env(home, model_dir, home / "cache", "0,1" if gpu else "")
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):  # (one host, as it is)
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               f"--master_port={_free_port()}", "-m", "scgrpo.cli", *_fit_args(gguf, gpu, nodes=1, devices=2)]
    (home / "run").mkdir(parents=True)
    ((code, err),) = _run_all([(command, home / "run", env)], home)
    assert code == 0, err[-3000:]
    return torch.load(home / "weights-rank0.pt", weights_only=True)


@pytest.fixture(scope="module")
def one_node_of_two(tiny_model_dir, tmp_path_factory):
    """:func:`_one_node_of_two`'s weights, run once per device kind for the module's tests."""
    runs: dict[bool, dict] = {}

    def weights(gpu: bool) -> dict:
        if gpu not in runs:
            runs[gpu] = _one_node_of_two(tmp_path_factory.mktemp("one-node"), tiny_model_dir, gpu)
        return runs[gpu]

    return weights


def _conversions(home) -> list[str]:
    path = home / "conversions.log"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("gpu, launcher", [(False, "torchrun"), (False, "slurm"),
                                           pytest.param(True, "torchrun", marks=TWO_GPUS)],
                         ids=["cpu-torchrun", "cpu-slurm", "gpu-torchrun"])
@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_processes(tiny_model_dir, tmp_path, gpu, launcher, one_node_of_two):
    """The torchrun nodes keep a cache each, the SLURM ones mount one: each cache is converted into once."""
    shared = tmp_path / "shared"  # the run folder's filesystem, mounted by both nodes
    shared.mkdir()
    shared_cache = launcher == "slurm"
    results = _launch_nodes(tmp_path, tiny_model_dir, [shared, shared], gpu=gpu, launcher=launcher,
                            shared_cache=shared_cache)
    for node, (code, err) in enumerate(results):
        assert code == 0, f"node {node}:\n" + err[-3000:]
    nodes = [torch.load(tmp_path / f"node{k}" / f"weights-rank{k}.pt", weights_only=True) for k in (0, 1)]
    reference = one_node_of_two(gpu)
    assert nodes[0] and set(nodes[0]) == set(nodes[1]) == set(reference)
    for name, tensor in reference.items():  # (a node that trained on the other's prompts, or alone, differs)
        for node in nodes:
            assert torch.equal(node[name], tensor), name
    assert any(t.abs().sum() > 0 for n, t in reference.items() if "lora_B" in n)  # (trained: B starts at zero)
    conversions = [_conversions(tmp_path / f"node{k}") for k in (0, 1)]
    if shared_cache:  # one conversion between them, and one folder
        assert len(conversions[0] + conversions[1]) == 1
        caches = [tmp_path / "shared-cache"]
    else:
        assert [len(c) for c in conversions] == [1, 1]
        caches = [tmp_path / f"node{k}" / "cache" for k in (0, 1)]
    for cache in caches:
        (folder,) = [f for f in glob.glob(str(cache / "models" / "tiny-*")) if os.path.isdir(f)]  # (and a lock file)
        assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    (run,) = glob.glob(str(shared / "runs" / "*" / "version_*"))
    assert os.path.isfile(os.path.join(run, "metrics.csv")) and os.path.isdir(os.path.join(run, "adapter", "final"))
    assert not glob.glob(os.path.join(run, ".scgrpo-shared-*"))  # the start-up check's marker is gone


@pytest.mark.slow
def test_a_run_folder_the_nodes_do_not_share_is_one_line_at_start(tiny_model_dir, tmp_path, monkeypatch):
    apart = [tmp_path / "disk0", tmp_path / "disk1"]  # each node writes runs/ on its own disk
    for folder in apart:
        folder.mkdir()
    monkeypatch.setenv("SCGRPO_SHARED_WAIT_S", "1")  # (not the 10 s a network filesystem is given: no marker comes)
    results = _launch_nodes(tmp_path, tiny_model_dir, apart)
    lines = [line for _, err in results for line in err.splitlines() if line.startswith("scgrpo: error:")]
    assert all(code != 0 for code, _ in results)
    assert len(lines) == 2 and all("is not shared by every node: rank 1 on" in line for line in lines), lines
    for _, err in results:  # the process's own output is that line; torchrun then reports the exit code its way
        assert "Traceback" not in err.split("failed (exitcode: 2)")[0]
    assert not _conversions(tmp_path / "node0")  # stopped before the model loads
    assert not glob.glob(str(tmp_path / "node*" / "weights-*.pt"))
