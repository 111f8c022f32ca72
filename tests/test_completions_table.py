"""CompletionsTable (callbacks/logging.py): each sample completion is written with its verifier's ``info``, whole in
completions.jsonl and as compact, cut JSON in the TensorBoard table; and the step numbers of a run's outputs, which
are metrics.csv's (:func:`step_numbers`)."""

import csv
import json
import os
import re

from lightning.pytorch.loggers import CSVLogger, Logger

from scgrpo.objectives import SCGRPO
from scgrpo.verifiers import VerificationResult, Verifier
from tests.helpers import tiny_data, tiny_module, tiny_trainer

STEP_OUTPUTS = ("metrics.csv", "completions.jsonl", "credit_tokens.jsonl", "credit_heatmap.html")


def step_numbers(log_dir: str) -> dict[str, list[int]]:
    """The training steps each output of a run folder holds, sorted: metrics.csv's train rows, the rows of
    completions.jsonl and credit_tokens.jsonl, the credit heatmap's step headings (an absent file: [])."""
    found = {}
    for name in STEP_OUTPUTS:
        path = os.path.join(log_dir, name)
        if not os.path.exists(path):
            found[name] = []
            continue
        with open(path, encoding="utf-8") as f:
            if name == "metrics.csv":
                steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")]
            elif name.endswith(".jsonl"):
                steps = [json.loads(line)["step"] for line in f]
            else:
                steps = [int(s) for s in re.findall(r"<h2>step (\d+)", f.read())]
        found[name] = sorted(set(steps))
    return found


class InfoVerifier(Verifier):
    """Scores parity, and says in its info what it read, with a column bar, a line break and a long note."""

    def verify(self, completion, answer, question=""):
        return VerificationResult(float(len(completion) % 2 == 0),
                                  {"seen": completion, "reason": "a|b\nc", "note": "x" * 300})


class TextLogger(Logger):
    """Stands in for TensorBoard: its experiment keeps what ``add_text`` is given."""

    def __init__(self):
        super().__init__()
        self.texts = []

    @property
    def name(self):
        return "text"

    @property
    def version(self):
        return 0

    @property
    def experiment(self):
        return self

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, text, global_step))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        pass


def test_each_completion_is_written_with_its_verifiers_info(tiny_model_dir, tmp_path):
    text = TextLogger()
    csv_logger = CSVLogger(str(tmp_path), name="run")
    module = tiny_module(tiny_model_dir, verifier=InfoVerifier(), log_completions_every_n_steps=1)
    tiny_trainer(tmp_path, logger=[csv_logger, text]).fit(module, tiny_data())

    with open(os.path.join(csv_logger.log_dir, "completions.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2 * 4  # two groups of G=4
    for row in rows:  # each row's own info, whole
        assert row["info"] == {"seen": row["completion"], "reason": "a|b\nc", "note": "x" * 300}

    ((tag, table, step),) = text.texts
    assert tag == "completions" and step == 0  # the first step, as metrics.csv numbers it
    header, rule, *lines = table.split("\n")
    assert header == "| reward | question | completion | info |" and rule == "|---|---|---|---|"
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows):
        info = line.split(" | ")[-1].removesuffix(" |")
        assert info.startswith('{"seen":') and '"reason":"a/b\\nc"' in info  # compact JSON, no column bar
        assert len(info) == 120 and info.endswith("…")  # cut: the note alone is 300 characters


def test_answers_are_written_as_json_values_not_their_python_text(tmp_path):
    """A row without an answer (reward functions on a table without that column) is null, a list of tests a list,
    a number a number; what JSON cannot hold is its text."""
    from types import SimpleNamespace

    import torch

    from scgrpo.callbacks.logging import CompletionsTable

    answers = [None, ["assert f(1) == 2"], 7, {1, 2}]
    rollouts = SimpleNamespace(group_size=2, completions=["a", "b", "c", "d"], sample_ids=[0, 0, 1, 1],
                               questions=["q"] * 4, answers=answers, rewards=torch.zeros(4),
                               completion_mask=torch.ones(4, 3), truncated=torch.zeros(4, dtype=torch.bool),
                               infos=None)
    progress = SimpleNamespace(batch_progress=SimpleNamespace(total=SimpleNamespace(completed=0)))
    trainer = SimpleNamespace(global_step=1, fit_loop=SimpleNamespace(epoch_loop=progress), loggers=[],
                              default_root_dir=str(tmp_path))
    CompletionsTable(every_n_steps=1).on_train_batch_end(trainer, None, None, SimpleNamespace(rollouts=rollouts), 0)
    with open(tmp_path / "completions.jsonl") as f:
        written = [json.loads(line)["answer"] for line in f]
    assert written == [None, ["assert f(1) == 2"], 7, "{1, 2}"]


def test_every_output_numbers_a_step_as_metrics_csv_does_also_with_several_optimiser_steps_a_batch(tiny_model_dir,
                                                                                                   tmp_path):
    """metrics.csv's train rows count training steps from 0 (one a rollout batch, whatever its optimiser steps);
    completions.jsonl, credit_tokens.jsonl and the heatmap give each step's rows that number. Two optimiser steps a
    batch: max_steps=4 is two training steps, logged at 0 and 1 (``trainer.global_step`` 2 and 4 at their ends)."""
    module = tiny_module(tiny_model_dir, objective=SCGRPO(num_iterations=2), log_completions_every_n_steps=1,
                         validate_before_training=True)
    trainer = tiny_trainer(tmp_path, max_steps=4, limit_val_batches=1, val_check_interval=1)
    trainer.fit(module, tiny_data(max_eval_prompts=2))
    assert step_numbers(trainer.log_dir) == {name: [0, 1] for name in STEP_OUTPUTS}
    # the validations before the first step and after each: at steps 0, 1 and 2, as the train rows count steps (the
    # optimiser steps behind the weights are val/global_step: 0, 2, 4)
    rows = list(csv.DictReader(open(os.path.join(trainer.log_dir, "metrics.csv"))))
    evaluations = [(int(r["step"]), float(r["val/global_step"])) for r in rows if r.get("val/global_step")]
    assert evaluations == [(0, 0.0), (1, 2.0), (2, 4.0)]
