"""``scgrpo/distributed.py`` in one process: what each helper does where there are no other ranks (the collectives'
own behaviour across ranks is tests/distributed/test_collectives.py's, the multi-process runs test_fsdp.py's and
test_multinode.py's)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from scgrpo.distributed import (PolicyRunner, all_reduce, check_run_shared, data_parallel_mesh, decoder_layers,
                                full_state, gather_values, is_sharded, mean_over_ranks, on_every_rank, sum_over_ranks,
                                world_size)
from tests.rollout.test_compact import tiny, with_lora


def test_one_process_is_a_world_of_one_and_its_reductions_leave_values_as_they_are():
    assert world_size() == 1
    assert all_reduce([1.5, -2.0], "sum") == [1.5, -2.0] and all_reduce([3.0], "max") == [3.0]
    values = torch.tensor([1.0, 2.0])
    assert gather_values(values) is values
    metrics = {"a": 1.0, "b": float("nan")}
    out = mean_over_ranks(metrics)
    assert out["a"] == 1.0 and math.isnan(out["b"])
    assert sum_over_ranks({"id": {"prompts": 2.0}}) == {"id": {"prompts": 2.0}}


def test_on_every_rank_returns_the_value_and_reraises_this_ranks_own_error():
    assert on_every_rank(lambda: 7, "counting") == 7
    with pytest.raises(ZeroDivisionError):
        on_every_rank(lambda: 1 / 0, "counting")


def test_the_runner_runs_a_closure_inside_its_forward_and_holds_the_policy():
    policy = nn.Linear(2, 2)
    runner = PolicyRunner(policy)
    seen = []
    assert runner(lambda: seen.append(1) or 5) == 5 and seen == [1]
    assert runner.policy is policy and not is_sharded(runner)


def test_the_decoder_layers_are_found_inside_a_peft_wrapper_and_a_model_without_them_is_named():
    model = tiny("llama", 64)
    assert decoder_layers(model) is model.model.layers
    assert decoder_layers(with_lora(tiny("llama", 64))) is not None

    class Flat(nn.Module):
        base_model_prefix = "body"

        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="cannot find the decoder layers of Flat"):
        decoder_layers(Flat())


def test_tensor_parallel_meshes_are_refused_and_a_data_parallel_one_is_taken():
    class Mesh:
        def __init__(self, names, sizes):
            self.mesh_dim_names, self.sizes = names, sizes

        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: self.sizes[name], name=name)

    with pytest.raises(ValueError, match="FSDP only"):
        data_parallel_mesh(Mesh(("data_parallel", "tensor_parallel"), {"data_parallel": 2, "tensor_parallel": 2}))
    assert data_parallel_mesh(Mesh(("data_parallel", "tensor_parallel"),
                                   {"data_parallel": 2, "tensor_parallel": 1})).name == "data_parallel"


def test_the_run_checks_nothing_shared_on_one_process_and_full_state_detaches():
    trainer = SimpleNamespace(log_dir="/nonexistent/run", default_root_dir="/nonexistent", checkpoint_callbacks=[],
                              ckpt_path="/nonexistent/last.ckpt")
    check_run_shared(trainer, "fit")  # (one process: no marker written, no folder needed)
    weight = nn.Parameter(torch.ones(2))
    state = full_state({"w": weight})
    assert not state["w"].requires_grad and torch.equal(state["w"], torch.ones(2))


def test_the_wait_for_the_shared_marker_is_ten_seconds_unless_the_environment_sets_it(monkeypatch):
    from scgrpo.distributed import shared_wait_s
    from scgrpo.errors import InputError

    monkeypatch.delenv("SCGRPO_SHARED_WAIT_S", raising=False)
    assert shared_wait_s() == 10.0
    monkeypatch.setenv("SCGRPO_SHARED_WAIT_S", "2.5")
    assert shared_wait_s() == 2.5
    monkeypatch.setenv("SCGRPO_SHARED_WAIT_S", "0")
    assert shared_wait_s() == 0.0
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("SCGRPO_SHARED_WAIT_S", bad)
        with pytest.raises(InputError, match=f"SCGRPO_SHARED_WAIT_S must be a finite number of seconds.*{bad!r}"):
            shared_wait_s()
