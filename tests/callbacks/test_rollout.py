"""The rollout callback (``scgrpo/callbacks/rollout.py``): it runs the module's rollout stage before each step, stores
the verified rollouts in the data module's buffer after it, and puts DAPO's extra prompt stream back on an
exception. Stand-ins for the trainer, the module and the data module: the callback touches nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from scgrpo.callbacks import RolloutCallback
from scgrpo.rollout.types import PromptBatch, RolloutBatch


def _rollouts(rewards):
    n = len(rewards)
    ids = torch.tensor([[5, 6, 0]] * n)
    return RolloutBatch(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), ids,
                        torch.tensor([[1.0, 1.0, 0.0]] * n), torch.zeros(n, dtype=torch.bool), n,
                        [f"p{i}" for i in range(n)], ["q"] * n, [0] * n, [f"c{i}" for i in range(n)],
                        rewards=torch.tensor(rewards))


class Stage:
    def __init__(self, rollouts, fail=None):
        self.rollouts, self.fail, self.seen = rollouts, fail, []

    def collect(self, batch, more=None):
        self.seen.append((batch, more))
        if self.fail is not None:
            raise self.fail
        return self.rollouts

    @staticmethod
    def verified_rows(rollouts, threshold):
        from scgrpo.stage import RolloutStage

        return RolloutStage.verified_rows(None, rollouts, threshold)


class Buffer:
    def __init__(self):
        self.added = []

    def add(self, *row):
        self.added.append(row)


class Data:
    def __init__(self):
        self.extra_consumed, self.verified_buffer = 0, Buffer()

    def extra_batch(self):
        self.extra_consumed += 1
        return PromptBatch(ids=["e"], questions=["e"], answers=[0])


def _module(stage, skipped=False):
    return SimpleNamespace(rollout_stage=stage, success_threshold=1.0, guard=SimpleNamespace(last_step_skipped=skipped),
                           device=torch.device("cpu"), budget=None, memory_budget_gib=None, micro_batch_size=None,
                           gradient_checkpointing=False, _trainer=None, global_step=3)


def test_the_stage_runs_before_the_step_with_the_extra_prompt_stream_and_the_batch_carries_its_rollouts():
    rollouts, data = _rollouts([1.0, 0.0]), Data()
    stage = Stage(rollouts)
    batch = PromptBatch(ids=["a"], questions=["a"], answers=[0])
    RolloutCallback().on_train_batch_start(SimpleNamespace(datamodule=data), _module(stage), batch, 0)
    assert batch.rollouts is rollouts and stage.seen[0][0] is batch
    assert stage.seen[0][1]().ids == ["e"] and data.extra_consumed == 1  # (more: the data module's extra_batch)
    RolloutCallback().on_train_batch_start(SimpleNamespace(datamodule=None), _module(stage), batch, 0)
    assert stage.seen[1][1] is None  # no data module: no extra rounds


def test_after_the_step_the_rollouts_at_the_threshold_go_to_the_buffer_unless_the_step_was_skipped():
    data = Data()
    batch = PromptBatch(ids=["a"], questions=["a"], answers=[0], rollouts=_rollouts([1.0, 0.0, 1.5]))
    trainer = SimpleNamespace(datamodule=data, global_step=7)
    RolloutCallback().on_train_batch_end(trainer, _module(Stage(None)), None, batch, 0)
    assert data.verified_buffer.added == [("p0", [5, 6], "c0", 1.0, 7), ("p2", [5, 6], "c2", 1.5, 7)]
    data.verified_buffer.added.clear()
    RolloutCallback().on_train_batch_end(trainer, _module(Stage(None), skipped=True), None, batch, 0)
    assert data.verified_buffer.added == []  # sampled from non-finite logits: not the policy's own


def test_an_exception_in_the_step_puts_the_extra_stream_back_where_the_step_found_it():
    data = Data()
    data.extra_consumed = 4
    callback = RolloutCallback()
    batch = PromptBatch(ids=["a"], questions=["a"], answers=[0])
    trainer = SimpleNamespace(datamodule=data, global_step=2)
    callback.on_train_batch_start(trainer, _module(Stage(_rollouts([1.0]))), batch, 0)
    data.extra_consumed = 6  # DAPO's extra rounds drew two batches
    callback.on_exception(trainer, None, KeyboardInterrupt())
    assert data.extra_consumed == 4
    callback.on_train_batch_start(trainer, _module(Stage(_rollouts([1.0]))), batch, 0)
    data.extra_consumed = 5
    callback.on_train_batch_end(trainer, _module(Stage(None)), None, batch, 0)  # a whole step: kept
    callback.on_exception(trainer, None, KeyboardInterrupt())
    assert data.extra_consumed == 5
