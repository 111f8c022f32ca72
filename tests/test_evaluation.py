"""Evaluation metrics: the fit's validations are logged at the optimiser steps done before them, and the test loop
logs ``test/<split>/...`` and says "test"."""

import csv
import os

from tests.helpers import tiny_data, tiny_module, tiny_trainer


def _rows(trainer) -> list[dict]:
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_the_validation_after_n_steps_is_logged_at_step_n(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, validate_before_training=True)
    trainer = tiny_trainer(tmp_path, max_steps=4, limit_val_batches=None, val_check_interval=2)
    trainer.fit(module, datamodule=tiny_data(max_eval_prompts=2))
    rows = _rows(trainer)
    validations = [(int(r["step"]), float(r["val/global_step"])) for r in rows if r.get("val/id/avg@2")]
    assert validations == [(0, 0.0), (2, 2.0), (4, 4.0)]  # the baseline, after 2 and after 4 steps
    assert [int(r["step"]) for r in rows if r.get("train/reward")] == [0, 1, 2, 3]  # (Lightning's: steps before)


def test_the_test_loop_logs_test_keys_and_says_test_where_validate_keeps_val(tiny_model_dir, tmp_path, caplog):
    module, data = tiny_module(tiny_model_dir), tiny_data(max_eval_prompts=2)
    trainer = tiny_trainer(tmp_path, limit_val_batches=None, limit_test_batches=None)
    with caplog.at_level("INFO", logger="scgrpo.evaluation"):
        (tested,) = trainer.test(module, datamodule=data)
        assert set(tested) == {"test/id/avg@2", "test/id/pass@2", "test/id/completion_length", "test/id/truncated",
                               "test/id/greedy", "test/id/time_s", "test/global_step"}
        assert "step 0 test [id] on 2 prompts" in caplog.text and "validation" not in caplog.text
        (validated,) = trainer.validate(module, datamodule=data)
        assert {key.replace("val/", "test/", 1) for key in validated} == set(tested)
        assert "step 0 validation [id] on 2 prompts" in caplog.text
    rows = _rows(trainer)
    assert [sorted(k.split("/")[0] for k, v in r.items() if v and "/" in k)[0] for r in rows] == ["test", "val"]


def test_testing_a_checkpoint_logs_at_the_checkpoint_s_step(tiny_model_dir, tmp_path, caplog):
    """Lightning restores no training step in ``test``: the checkpoint's own is the one the metrics belong to."""
    trainer = tiny_trainer(tmp_path / "fit", max_steps=2)
    trainer.fit(tiny_module(tiny_model_dir), datamodule=tiny_data())
    checkpoint = str(tmp_path / "two-steps.ckpt")
    trainer.save_checkpoint(checkpoint)
    tester = tiny_trainer(tmp_path / "test", limit_test_batches=None)
    with caplog.at_level("INFO", logger="scgrpo.evaluation"):
        (tested,) = tester.test(tiny_module(tiny_model_dir), datamodule=tiny_data(max_eval_prompts=2),
                                ckpt_path=checkpoint)
    assert tested["test/global_step"] == 2.0 and "step 2 test [id]" in caplog.text
    assert [int(r["step"]) for r in _rows(tester)] == [2]


def test_each_split_logs_its_own_time_not_the_whole_validations(monkeypatch):
    """``<stage>/<split>/time_s`` is the time of that split's batches: a clock that advances 1 s in each id batch
    and 3 s in each ood batch gives 2 s to id (two batches) and 3 s to ood, whatever came before."""
    from types import SimpleNamespace

    import scgrpo.evaluation as evaluation

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: clock.now)
    ev = evaluation.Evaluation(k=1, temperature=None, greedy=False, success_threshold=0.5)

    def fake_add(batch, policy, verifier, episodes):
        clock.now += {"id": 1.0, "ood": 3.0}[batch.split]
        ev.sums.setdefault(batch.split, {"prompts": 1.0, "avg": 0.0, "pass": 0.0, "length": 0.0, "truncated": 0.0})

    monkeypatch.setattr(ev, "_add", fake_add)
    ev.start()
    clock.now += 50.0  # (time before the first batch: not any split's)
    for split in ("id", "id", "ood"):
        ev.add(SimpleNamespace(split=split), None, None)
    metrics = ev.metrics(step=0, log_summary=False)
    assert metrics["id"]["val/id/time_s"] == 2.0 and metrics["ood"]["val/ood/time_s"] == 3.0


def test_a_long_evaluation_logs_its_progress_every_15_seconds(monkeypatch, caplog):
    """A batch of 10 s each: lines after the 2nd, 4th and 6th batch (20 s, 40 s, 60 s), each with the prompts done;
    none for an evaluation shorter than 15 s."""
    from types import SimpleNamespace

    import scgrpo.evaluation as evaluation

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: clock.now)
    ev = evaluation.Evaluation(k=1, temperature=None, greedy=False, success_threshold=0.5)

    def fake_add(batch, policy, verifier, episodes):
        clock.now += 10.0
        ev.sums.setdefault(batch.split, {"prompts": 0.0})["prompts"] += 8

    monkeypatch.setattr(ev, "_add", fake_add)
    ev.start()
    with caplog.at_level("INFO", logger="scgrpo.evaluation"):
        for _ in range(6):
            ev.add(SimpleNamespace(split="id"), None, None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluating")]
    assert lines == ["evaluating [id]: 16 prompts done (this rank), 20 s in this split",
                     "evaluating [id]: 32 prompts done (this rank), 40 s in this split",
                     "evaluating [id]: 48 prompts done (this rank), 60 s in this split"]
    caplog.clear()
    ev.start()
    with caplog.at_level("INFO", logger="scgrpo.evaluation"):
        ev.add(SimpleNamespace(split="ood"), None, None)
    assert not [r for r in caplog.records if r.getMessage().startswith("evaluating")]
