"""A rank that fails before the ranks' first collective stops the others with its message: two gloo processes on
CPU, one of which cannot load its model (without the check, the other would wait in its next collective until the
process group's timeout)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scgrpo.distributed import on_every_rank
from scgrpo.policy import build_policy
from scgrpo.rollout.engine import GenerationSettings

TIMEOUT = timedelta(seconds=120)  # (a regression waits this long, then fails, rather than hanging the suite)


def _worker(rank: int, store: str, models: list, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        try:
            on_every_rank(lambda: 1 if rank == 0 else 1 / 0, "counting")
            out[rank, "unit"] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
            out[rank, "unit"] = f"{type(err).__name__}: {err}"
        try:
            build_policy(models[rank], "float32", None, None, torch.device("cpu"), GenerationSettings())
            out[rank, "model"] = "loaded"
        except Exception as err:  # noqa: BLE001
            out[rank, "model"] = f"{type(err).__name__}: {err}"
        dist.barrier()  # (both ranks still reach a collective after a failure was reported)
        out[rank, "after"] = "reached"
    finally:
        dist.destroy_process_group()


def test_a_rank_that_fails_to_load_its_model_stops_the_other_with_its_message(tiny_model_dir, tmp_path):
    broken = tmp_path / "no-model"
    broken.mkdir()  # a folder without config.json, as a half-written conversion leaves it
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(str(tmp_path / "store"), [tiny_model_dir, str(broken)], out), nprocs=2,
                       join=True, start_method="fork")
    assert out[0, "unit"].startswith("RankFailed: counting failed on rank(s) 1: rank 1: ZeroDivisionError")
    assert out[1, "unit"].startswith("ZeroDivisionError")
    assert out[0, "model"].startswith("RankFailed: loading the model failed on rank(s) 1: rank 1: ")
    assert f"FileNotFoundError: model folder {broken} has no config.json" in out[0, "model"]  # rank 1's message
    assert out[1, "model"].startswith("FileNotFoundError: model folder")  # the failed rank raises its own error
    assert out[0, "after"] == out[1, "after"] == "reached"


def test_on_one_process_the_error_is_raised_as_it_is():
    assert on_every_rank(lambda: 3, "counting") == 3
    try:
        on_every_rank(lambda: {}["x"], "counting")
    except KeyError:
        pass
    else:
        raise AssertionError("the error was swallowed")
    assert not (dist.is_available() and dist.is_initialized())  # (one process: no gather was needed)
