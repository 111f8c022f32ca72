"""credit/pivot_* in a training run on a scripted environment that marks its decisions, recomputed independently
from the run's credit_tokens.jsonl; a run whose task marks none logs none of the keys and says so once."""

from __future__ import annotations

import csv
import glob
import itertools
import json
import logging
import math
import os

import pytest

from scgrpo.envs import EpisodeSettings, Environment, StepResult
from scgrpo.objectives import SCGRPO
from tests.envs.scripted import Scripted
from tests.helpers import tiny_data, tiny_module, tiny_trainer

SPECIAL = {"<|im_end|>", "<|im_start|>", "<|endoftext|>"}


class Marking(Environment):
    """Two model turns. A turn whose first three characters are ASCII (the tiny model writes random bytes) marks
    its first two characters as a decision (right on the first turn, wrong on the second) and, on the second
    turn, characters 1-2 of such a first turn as a wrong decision judged later, so the first turn's second
    character is split between a right and a wrong decision. Reward 1 when the first turn's first character has
    an even code (it varies within a group)."""

    def reset(self, row, seed):
        self.t, self.first = 0, ""
        return f"Task {row['question']}"

    def step(self, action):
        self.t += 1
        text = action.text
        marks = [{"span": [0, 2], "correct": self.t == 1}] if marked(text) else []
        if self.t == 1:
            self.first = text
            return StepResult(observation="obs1", info={"decisions": marks})
        if marked(self.first):
            marks.append({"turn": 0, "span": [1, 3], "correct": False})
        reward = float(bool(self.first) and ord(self.first[0]) % 2 == 0)
        return StepResult(reward=reward, done=True, info={"decisions": marks})


def marked(text: str) -> bool:
    return len(text) >= 3 and text[:3].isascii()


def independent_labels(row: dict) -> list[int]:
    """Each token's label from the decisions the environment made, by the token texts' own lengths: the turns are
    the runs of model tokens, each stripped of its leading spaces as the runner hands it to the environment. (A
    byte of a character split over tokens reads as one replacement character: past a turn's ASCII start the
    positions only run ahead, and the marks lie in its first three characters.)"""
    labels = [0] * len(row["tokens"])
    runs = [list(g) for key, g in itertools.groupby(range(len(row["model"])), key=lambda k: row["model"][k]) if key]
    texts = []
    for run in runs:
        pieces = ["" if row["tokens"][k] in SPECIAL else row["tokens"][k] for k in run]
        texts.append("".join(pieces))
    marks: dict[int, list] = {}  # turn -> [(span, 1 right / 2 wrong)]
    if runs and marked(texts[0].strip()):
        marks[0] = [((0, 2), 1)] + ([((1, 3), 2)] if len(runs) > 1 else [])
    if len(runs) > 1 and marked(texts[1].strip()):
        marks[1] = [((0, 2), 2)]
    for turn, run in enumerate(runs):
        lead = len(texts[turn]) - len(texts[turn].lstrip())
        position = -lead
        for k in run:
            piece = "" if row["tokens"][k] in SPECIAL else row["tokens"][k]
            a, b = position, position + len(piece)
            position = b
            for (s, e), label in marks.get(turn, []):
                if b > a and a < e and b > s:
                    labels[k] |= label
    return labels


def brute(rows: list[dict]) -> tuple[float, float, int]:
    """AUROC of f at wrong against right decision tokens (pairs, ties half) and the decisions' share of f over
    their share of tokens, over failed partial-solve rows with a teacher that hold a decision."""
    rows = [{**r, "decision": r.get("decision", [0] * len(r["tokens"]))} for r in rows]
    chosen = [r for r in rows if r["route"] == "partial" and r["has_teacher"] and r["reward"] < 1
              and any(d for d, m in zip(r["decision"], r["model"]) if m)]
    if not chosen:
        return float("nan"), float("nan"), 0
    wrong = [f for r in chosen for f, d, m in zip(r["f"], r["decision"], r["model"]) if m and d == 2]
    right = [f for r in chosen for f, d, m in zip(r["f"], r["decision"], r["model"]) if m and d == 1]
    pairs = [1.0 if w > r else 0.5 if w == r else 0.0 for w in wrong for r in right]
    f_all = sum(f for r in chosen for f, m in zip(r["f"], r["model"]) if m)
    f_dec = sum(f for r in chosen for f, d, m in zip(r["f"], r["decision"], r["model"]) if m and d)
    n_all = sum(sum(r["model"]) for r in chosen)
    n_dec = sum(1 for r in chosen for d, m in zip(r["decision"], r["model"]) if m and d)
    return (sum(pairs) / len(pairs) if pairs else float("nan")), (f_dec / f_all) / (n_dec / n_all), len(chosen)


def test_pivot_metrics_of_a_run_match_an_independent_count_of_its_logged_tokens(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, environment=Marking(), objective=SCGRPO(),
                         episodes=EpisodeSettings(max_turns=2, max_episode_tokens=48), log_completions_every_n_steps=1,
                         dtype="float32")
    trainer = tiny_trainer(tmp_path, max_steps=3)
    trainer.fit(module, tiny_data(batch_size=16))
    metrics = [r for r in csv.DictReader(open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0]))
               if r.get("credit/pivot_rows")]
    rows = [json.loads(line) for line in open(os.path.join(trainer.log_dir, "credit_tokens.jsonl"))]
    checked = split = 0
    for step_metrics in metrics:
        step = int(step_metrics["step"])
        logged = [r for r in rows if r["step"] == step]  # (the step's rows, numbered as metrics.csv numbers it)
        for row in logged:
            assert row.get("decision", [0] * len(row["tokens"])) == independent_labels(row)
            split += 3 in row["decision"]
        auroc, share, count = brute(logged)
        assert float(step_metrics["credit/pivot_rows"]) == count
        if count:
            assert float(step_metrics["credit/pivot_share"]) == pytest.approx(share, rel=1e-3)
            if math.isnan(auroc):  # rows counted, but no right or no wrong decision token among them
                assert math.isnan(float(step_metrics["credit/pivot_auroc"]))
                continue
            assert float(step_metrics["credit/pivot_auroc"]) == pytest.approx(auroc, abs=1e-3)
            checked += 1
    assert checked >= 1 and split > 0  # steps with rows counted, and rows whose decisions split a token
    page = open(os.path.join(trainer.log_dir, "credit_heatmap.html")).read()
    assert "outline:2px solid" in page and "wrong decision" in page


def test_a_task_that_marks_no_decisions_logs_no_pivot_keys_and_says_so_once(tiny_model_dir, tmp_path, caplog):
    module = tiny_module(tiny_model_dir, environment=Scripted(turns=2), objective=SCGRPO(),
                         episodes=EpisodeSettings(max_turns=2, max_episode_tokens=48), log_completions_every_n_steps=1,
                         dtype="float32")
    with caplog.at_level(logging.INFO, logger="scgrpo.callbacks.credit"):
        tiny_trainer(tmp_path, max_steps=2).fit(module, tiny_data())
    header = open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0]).readline()
    assert "credit/teacher_rows" in header and "pivot" not in header
    assert sum("marks no decisions" in r.getMessage() for r in caplog.records) == 1


def test_pivot_keys_are_nan_between_credit_logging_steps(tiny_model_dir, tmp_path):
    """Lightning logs a callback's key again at every later step unless it is logged anew: between the logging
    steps the keys read NaN, not the last step's values."""
    module = tiny_module(tiny_model_dir, environment=Marking(), objective=SCGRPO(),
                         episodes=EpisodeSettings(max_turns=2, max_episode_tokens=48), log_completions_every_n_steps=2,
                         dtype="float32")
    tiny_trainer(tmp_path, max_steps=3).fit(module, tiny_data(batch_size=16))
    rows = [r for r in csv.DictReader(open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0]))
            if r.get("train/reward")]
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["credit/pivot_rows"] != "nan" and rows[2]["credit/pivot_rows"] != "nan"
    assert all(math.isnan(float(rows[1][key])) for key in
               ("credit/pivot_rows", "credit/pivot_auroc", "credit/pivot_share"))
