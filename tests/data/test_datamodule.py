"""The data module: an evaluation-only source (no train split) validates and tests; fitting on it is one error."""

import pytest

from scgrpo.cli import main
from scgrpo.data import PromptDataModule
from scgrpo.data.sources import PromptSource
from scgrpo.data.tasks import ArithmeticTask
from scgrpo.errors import InputError
from tests.helpers import tiny_module, tiny_trainer


class EvalOnlyArithmetic(PromptSource):
    """Arithmetic's held-out splits alone, as a test set without a training set is."""

    def __init__(self) -> None:
        self.task = ArithmeticTask(num_eval=4, num_ood=4)

    def splits(self) -> list[str]:
        return ["id", "ood"]

    def rows(self, split: str):
        if split not in self.splits():
            raise ValueError(f"no split {split!r}; splits: {self.splits()}")
        return self.task.rows(split)


def test_validate_and_test_need_no_train_split(tiny_model_dir, tmp_path):
    data = PromptDataModule(source=EvalOnlyArithmetic(), eval_batch_size=4)
    assert data.eval_splits == ["id", "ood"]
    trainer = tiny_trainer(tmp_path, limit_val_batches=None, limit_test_batches=None)
    module = tiny_module(tiny_model_dir)
    validated = trainer.validate(module, datamodule=data)
    tested = trainer.test(module, datamodule=data)
    assert {k for m in validated for k in m if k.endswith("avg@2")} == {"val/id/avg@2", "val/ood/avg@2"}
    assert {k for m in tested for k in m if k.endswith("avg@2")} == {"test/id/avg@2", "test/ood/avg@2"}


def test_fit_without_a_train_split_is_one_error_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    data = PromptDataModule(source=EvalOnlyArithmetic())
    with pytest.raises(InputError, match=r"has no train split, only \['id', 'ood'\]: scgrpo fit trains on one"):
        data.setup("fit")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--model.model={tiny_model_dir}", "--trainer.accelerator=cpu", "--trainer.max_steps=1",
              "--data.source.class_path=tests.data.test_datamodule.EvalOnlyArithmetic"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("scgrpo: error: data.source (EvalOnlyArithmetic) has no train split")


def test_a_final_split_is_evaluated_at_the_fits_last_step_only_and_by_validate(tiny_model_dir, tmp_path):
    import csv

    data = PromptDataModule(source=ArithmeticTask(num_eval=4, num_ood=4), batch_size=2, eval_batch_size=4,
                            eval_splits=["id"], final_splits=["ood"])
    assert data.eval_splits == ["id", "ood"] and data.final_splits == ["ood"]
    trainer = tiny_trainer(tmp_path, max_steps=4, limit_val_batches=None, val_check_interval=2,
                           check_val_every_n_epoch=None)
    trainer.fit(tiny_module(tiny_model_dir, validate_before_training=True), datamodule=data)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = {split: [int(float(r["val/global_step"])) for r in rows if r.get(f"val/{split}/avg@2")]
             for split in ("id", "ood")}
    assert steps == {"id": [0, 2, 4], "ood": [4]}  # before training, every 2 steps; ood at the end only
    validated = tiny_trainer(tmp_path / "v", limit_val_batches=None).validate(tiny_module(tiny_model_dir),
                                                                              datamodule=data)
    assert {k for m in validated for k in m if k.endswith("avg@2")} == {"val/id/avg@2", "val/ood/avg@2"}
    with pytest.raises(ValueError, match=r"data.final_splits \['test'\] are not splits of ArithmeticTask \(its evaluation "
                                         r"splits are \['id', 'ood'\]\): set data.final_splits to some of"):
        PromptDataModule(source=ArithmeticTask(), final_splits=["test"])
    off = tiny_trainer(tmp_path / "off", max_steps=5, limit_val_batches=None, val_check_interval=2,
                       check_val_every_n_epoch=None)
    with pytest.raises(InputError, match=r"max_steps=5 is no multiple of trainer.val_check_interval=2: no "
                                         r"evaluation falls there \(set max_steps to 6\)"):
        off.fit(tiny_module(tiny_model_dir), datamodule=data)


def test_a_final_split_deals_its_rows_to_the_ranks():
    """Its loader is an iterable Lightning gives no distributed sampler: each rank gets every world-th row."""

    class Ranked:
        global_rank, world_size, lightning_module, sanity_checking, max_steps, global_step = 1, 2, None, False, 4, 4

        class state:
            fn = "fit"

    data = PromptDataModule(source=ArithmeticTask(num_eval=4, num_ood=5), eval_batch_size=8, eval_splits=["id"],
                            final_splits=["ood"])
    data.trainer = Ranked()
    _, final = data.val_dataloader()
    (batch,) = list(final)
    assert batch.ids == [r["id"] for r in data.source.rows("ood")[1::2]]


def test_own_data_on_a_config_that_names_eval_splits_says_what_to_change_after_the_datas_own_errors(tmp_path):
    from scgrpo.data.sources import FileSource

    good = tmp_path / "train.jsonl"
    good.write_text('{"question": "1+1", "answer": 2}\n')
    with pytest.raises(ValueError) as raised:
        PromptDataModule(source=FileSource(str(good)), eval_splits=["id"])
    assert str(raised.value) == (
        "data.eval_splits ['id'] are not splits of FileSource (it has no evaluation split): set data.eval_splits: [] "
        "(no evaluation), or give a file for each: data.source.init_args.files: {train: ..., id: ...}")
    assert PromptDataModule(source=FileSource(str(good)), eval_splits=[]).eval_splits == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": 2}\n{"question": "2+2", \n')
    with pytest.raises((ValueError, InputError)) as raised:  # the file's own fault, not the missing split
        PromptDataModule(source=FileSource(str(bad)), eval_splits=["id"])
    assert "bad.jsonl" in str(raised.value) and "eval_splits" not in str(raised.value)


def test_both_split_lists_wrong_are_one_message_and_a_hub_dataset_is_not_downloaded_for_it(tmp_path, monkeypatch):
    import datasets

    from scgrpo.data.sources import FileSource, HubDataset

    good = tmp_path / "train.jsonl"
    good.write_text('{"question": "1+1", "answer": 2}\n')
    with pytest.raises(ValueError) as raised:
        PromptDataModule(source=FileSource(str(good)), eval_splits=["id"], final_splits=["ood"])
    assert str(raised.value).startswith("data.eval_splits ['id'] and data.final_splits ['ood'] are not splits of "
                                        "FileSource (it has no evaluation split): set data.eval_splits: [] and set "
                                        "data.final_splits: [] (no evaluation)")

    def no_network(*args, **kwargs):
        raise AssertionError("downloaded")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(ValueError, match=r"data.eval_splits \['id'\] are not splits of HubDataset .*"
                                         r"data.source.init_args.splits: \{train: ..., id: ...\}"):
        PromptDataModule(source=HubDataset("org/data", splits={"train": "train"}), eval_splits=["id"])
