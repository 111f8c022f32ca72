"""Several GPUs: FSDP2 sharding of the policy, gathered parameters for generation, cross-rank sums.

The policy sits inside :class:`PolicyRunner`, whose forward runs any function given to it. Sharded with
``fully_shard`` (each decoder layer a unit, the runner the root), every computation that touches the weights
goes through the runner, so FSDP gathers the root's parameters (embeddings, final norm, LM head) and
registers its backward hooks, while each layer gathers its own on use. Passes whose number depends on the
data (generation stops when every row has ended, teacher passes depend on references) run inside
:func:`full_parameters`: every unit is gathered once, and no collective runs until the window closes, so
ranks never wait on one another in the middle of a decode loop.

Frozen base weights carry no gradient memory (FSDP2 keeps ``requires_grad`` per parameter); LoRA weights
stay fp32 in the optimizer and are gathered in the compute dtype (``MixedPrecisionPolicy``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

log = logging.getLogger(__name__)


class PolicyRunner(nn.Module):
    """Holds the policy; ``runner(fn)`` calls ``fn()`` inside this module's forward.

    ``fn`` takes no arguments on purpose: FSDP's root forward copies the containers in its arguments while
    moving them to the GPU, and state written into such a copy (a cache, a batch's log-probs) would be lost.
    Pass a closure instead."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, fn: Callable[[], Any]) -> Any:
        return fn()


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with every process in the data-parallel (FSDP) dimension.

    ``RLVRModule.configure_model`` shards the policy over that dimension. Checkpoints hold only the trainable
    (LoRA) tensors, gathered to rank 0 into one file by default (``save_distributed_checkpoint=False``);
    frozen base weights are never gathered for a checkpoint.
    """

    def __init__(self, save_distributed_checkpoint: bool = False, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def data_parallel_mesh(device_mesh):
    """The mesh FSDP shards over; tensor parallelism is not supported."""
    names = device_mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "scgrpo shards the policy with FSDP only: use scgrpo.distributed.FSDP2Strategy (or set "
            "tensor_parallel_size: 1 and data_parallel_size: <number of GPUs> on ModelParallelStrategy)"
        )
    return device_mesh["data_parallel"] if "data_parallel" in names else device_mesh


def decoder_layers(policy: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (inside a peft wrapper or not)."""
    causal_lm = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    backbone = getattr(causal_lm, causal_lm.base_model_prefix)
    layers = getattr(backbone, "layers", None) or getattr(backbone, "h", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(causal_lm).__name__} to shard them")
    return layers


def shard_policy(runner: PolicyRunner, mesh, compute_dtype: Optional[torch.dtype] = None) -> None:
    """``fully_shard`` each decoder layer and the runner (the root) over ``mesh``.

    With parameters of several dtypes (fp32 LoRA on a bf16 base), FSDP gathers them all in ``compute_dtype``
    and reduces gradients in fp32; the stored (sharded) LoRA weights stay fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {p.dtype for p in runner.parameters() if p.dtype.is_floating_point}
    kwargs: dict[str, Any] = {"mesh": mesh}
    if len(dtypes) > 1:
        param_dtype = compute_dtype or min(dtypes, key=lambda d: torch.finfo(d).bits)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = decoder_layers(runner.policy)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(runner, **kwargs)
    # Backward prefetching by layer index, not by FSDP's record of forward order: no-grad passes (teacher,
    # generation) add to that record as many entries as their rank ran, and ranks would then prefetch
    # different units. Layer 0 names itself, which is already gathered when its backward starts.
    for i, layer in enumerate(layers):
        layer.set_modules_to_backward_prefetch([layers[i - 1] if i > 0 else layer])


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def full_parameters(runner: nn.Module) -> Iterator[None]:
    """Every FSDP unit inside ``runner`` gathered once and kept gathered until exit; a no-op when not sharded.

    Call inside the runner's forward: FSDP is then initialised and the root's own parameters are in place."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in runner.modules() if isinstance(m, FSDPModule) and m is not runner]  # the root is gathered
    if not units:
        yield
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RankFailed(RuntimeError):
    """Another rank failed in a step every rank runs (its message is this one's)."""


def on_every_rank(prepare: Callable[[], Any], what: str) -> Any:
    """``prepare()`` on this rank; with several ranks, each then learns (one collective that every rank reaches,
    failed or not) whether another failed: a rank whose ``prepare`` raised raises its own error, the others
    :class:`RankFailed` with the failed ranks' messages, rather than waiting in the next collective for a rank that
    will never come. ``what`` names the step in that message."""
    error: Optional[BaseException] = None
    try:
        result = prepare()
    except BaseException as err:  # noqa: BLE001 - re-raised below, after the other ranks have heard of it
        error, result = err, None
    if world_size() > 1:
        messages: list[Optional[str]] = [None] * world_size()
        mine = None if error is None else f"{type(error).__name__}: {' '.join(str(error).split())}"
        dist.all_gather_object(messages, mine)
        failed = {rank: message for rank, message in enumerate(messages) if message is not None}
        if failed and error is None:
            raise RankFailed(f"{what} failed on rank(s) {', '.join(map(str, failed))}: "
                             + "; ".join(f"rank {r}: {m}" for r, m in failed.items()))
    if error is not None:
        raise error
    return result


SHARED_WAIT_S = 10.0
"""How long a rank looks for rank 0's marker (a network filesystem may show a new file to other hosts late);
``SCGRPO_SHARED_WAIT_S`` in the environment sets it (longer for a filesystem slower to show new files)"""


def shared_wait_s() -> float:
    """:data:`SHARED_WAIT_S`, or the seconds ``SCGRPO_SHARED_WAIT_S`` gives."""
    given = os.environ.get("SCGRPO_SHARED_WAIT_S")
    if not given:
        return SHARED_WAIT_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not (seconds >= 0 and math.isfinite(seconds)):
        from scgrpo.errors import InputError

        raise InputError(f"SCGRPO_SHARED_WAIT_S must be a finite number of seconds (0 or more), got {given!r}")
    return seconds


def check_run_shared(trainer, stage: str) -> None:
    """Every rank sees the checkpoint it will read (``ckpt_path``) and, in a fit, the folders rank 0 writes
    checkpoints and the adapter into (:func:`check_shared`)."""
    folders = []
    if stage == "fit":
        folders = [trainer.log_dir or trainer.default_root_dir,
                   *(getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks)]
    path = trainer.ckpt_path
    check_shared([f for f in folders if f], [path] if isinstance(path, str) else [])


def check_shared(folders: Sequence[str], files: Sequence[str] = ()) -> None:
    """With several ranks: every rank must see ``files`` (checkpoints it will read: those that rank 0 finds) and what
    rank 0 writes into each of
    ``folders`` (where rank 0 writes checkpoints and adapters that every rank reads back on resume): rank 0 writes a
    marker file into each, and every rank reads it back. Otherwise every rank ends with the same one-line
    :class:`~scgrpo.errors.InputError` naming the ranks and hosts that miss it. Folders that are not on a local
    filesystem (``s3://...``) are left to their store. Every rank must call it; nothing on one process."""
    if world_size() == 1:
        return
    from scgrpo.errors import InputError
    from scgrpo.lightning_internals import is_local_path

    wait_s = on_every_rank(shared_wait_s, "reading SCGRPO_SHARED_WAIT_S")  # (a bad value on one node ends all)

    folders = [os.path.abspath(f) for f in dict.fromkeys(folders) if f and is_local_path(f)]
    first = dist.get_rank() == 0
    token = [secrets.token_hex(8) if first else None,
             [f for f in files if is_local_path(f) and os.path.isfile(f)] if first else None]
    dist.broadcast_object_list(token, src=0)
    files = token[1]
    markers = [os.path.join(folder, f".scgrpo-shared-{token[0]}") for folder in folders]
    unwritable = None
    if dist.get_rank() == 0:
        for marker in markers:
            try:
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                with open(marker, "w") as f:
                    f.write(token[0])
            except OSError as err:
                unwritable = f"rank 0 cannot write into {os.path.dirname(marker)}: {err.strerror or err}"
                break
    dist.barrier()
    deadline = time.monotonic() + wait_s

    def missing() -> list[str]:
        return ([m for m in markers if not _reads(m, token[0])] if unwritable is None else []) + \
               [f for f in files if not os.path.isfile(f)]

    while missing() and time.monotonic() < deadline and unwritable is None:
        time.sleep(0.2)
    seen: list[Any] = [None] * world_size()
    dist.all_gather_object(seen, (missing(), socket.gethostname(), unwritable))
    if dist.get_rank() == 0:
        for marker in markers:
            with contextlib.suppress(OSError):
                os.remove(marker)
    unwritable = next((u for _, _, u in seen if u), None)
    if unwritable:
        raise InputError(f"{unwritable}; checkpoints and adapters are written there")
    blind = [(rank, host, paths) for rank, (paths, host, _) in enumerate(seen) if paths]
    if blind:
        rank, host, paths = blind[0]
        path = paths[0]
        what = (f"the checkpoint {path}" if path in files else
                f"the run folder {os.path.dirname(path)} (the file rank 0 wrote there)")
        others = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
        raise InputError(f"{what} is not shared by every node: rank {rank} on {host}{others} does not see it. Rank 0 "
                         "writes checkpoints and adapters there and every rank reads them back on resume: put "
                         "trainer.default_root_dir (or the logger's save_dir, the checkpoint's dirpath, ckpt_path) "
                         "on a filesystem all nodes mount")


def _reads(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def all_reduce(values: list[float], op: str = "sum", device: Optional[torch.device] = None) -> list[float]:
    """Element-wise sum or max of ``values`` over ranks (one collective); ``values`` unchanged on one rank."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def gather_values(values: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor's values from every rank, concatenated in rank order (ranks may hold different numbers);
    the tensor itself on one rank."""
    if world_size() == 1:
        return values
    values = values.reshape(-1)
    count = torch.tensor([values.numel()], device=values.device)
    counts = [torch.zeros_like(count) for _ in range(world_size())]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = torch.nn.functional.pad(values, (0, max(sizes) - values.numel()))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric averaged over the ranks that report it (NaN-aware); one ``all_gather_object``."""
    if world_size() == 1:
        return metrics
    gathered: list[Optional[dict[str, float]]] = [None] * world_size()
    dist.all_gather_object(gathered, metrics)
    out = {}
    for key in sorted({k for part in gathered if part for k in part}):
        values = torch.tensor([part[key] for part in gathered if part and key in part], dtype=torch.float64)
        finite = values[~values.isnan()]
        out[key] = float(finite.mean()) if len(finite) else float("nan")
    return out


def sum_over_ranks(tables: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``{name: {key: value}}`` summed key by key over ranks (one ``all_gather_object``)."""
    if world_size() == 1:
        return tables
    gathered: list[Optional[dict]] = [None] * world_size()
    dist.all_gather_object(gathered, {name: dict(table) for name, table in tables.items()})
    out: dict[str, dict[str, float]] = {}
    for part in gathered:
        for name, table in (part or {}).items():
            into = out.setdefault(name, {})
            for key, value in table.items():
                into[key] = into.get(key, 0.0) + value
    return out


def max_over_ranks(table: dict[str, float]) -> dict[str, float]:
    """``{key: value}``, each key's largest value over ranks (one ``all_gather_object``: any device, any backend)."""
    if world_size() == 1:
        return dict(table)
    gathered: list[Optional[dict]] = [None] * world_size()
    dist.all_gather_object(gathered, dict(table))
    out: dict[str, float] = {}
    for part in gathered:
        for key, value in (part or {}).items():
            out[key] = max(out.get(key, value), value)
    return out


def full_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sharded (DTensor) entries gathered whole; a collective, so every rank must call it."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in tensors.items()}
