"""The ``scgrpo`` console script run from a folder that holds the user's own modules, as README says: an environment
and a reward function are found by their class paths without PYTHONPATH (``python -m scgrpo.cli`` had the working
folder on the import path; the console script did not)."""

from __future__ import annotations

import csv
import glob
import os
import shutil
import subprocess
import sys

import pytest

from scgrpo.cli import working_folder_importable
from tests.helpers import code_blocks, readme_section

SCRIPT = shutil.which("scgrpo")
needs_script = pytest.mark.skipif(SCRIPT is None, reason="the scgrpo console script is not installed")

ENVIRONMENT = '''from scgrpo.envs import Environment, StepResult


class Guess(Environment):
    """Two turns: any first reply is answered with a hint, the second scores 1 if it holds the answer."""

    def reset(self, row, seed):
        self.answer, self.turn = str(row["answer"]), 0
        return f"Guess the number. {row['question']}"

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult(observation="Try again.")
        return StepResult(reward=float(self.answer in action.text), done=True)
'''
REWARD = '''def has_digit(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]
'''


def _run(folder, tiny_model_dir, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (as a user's shell has it)
    command = [SCRIPT, "fit", *args, f"--model.model={tiny_model_dir}", "--model.dtype=float32",
               "--model.generation.max_new_tokens=6", "--model.generation.num_generations=2", "--trainer.accelerator=cpu",
               "--trainer.max_steps=1", "--data.batch_size=2", "--data.eval_splits=[]",
               "--model.validate_before_training=false", "--model.log_completions_every_n_steps=0",
               "--trainer.enable_progress_bar=false"]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = glob.glob(str(folder / "runs" / "*" / "version_*"))
    return [row for row in csv.DictReader(open(os.path.join(run, "metrics.csv")))]


@needs_script
@pytest.mark.slow
def test_an_environment_in_the_working_folder_is_found_by_its_class_path(tiny_model_dir, tmp_path):
    work = tmp_path / "mywork"
    (work / "my_pkg").mkdir(parents=True)
    (work / "my_pkg" / "__init__.py").write_text("")
    (work / "my_pkg" / "guess.py").write_text(ENVIRONMENT)
    (work / "guess.yaml").write_text("model:\n  environment: {class_path: my_pkg.guess.Guess}\n"
                                     "  episodes: {max_turns: 3, max_episode_tokens: 40}\n")
    rows = _run(work, tiny_model_dir, "--config=guess.yaml")
    turns = [float(r["episode/turns_mean"]) for r in rows if r.get("episode/turns_mean")]
    assert turns == [2.0]  # the user's environment played the episodes: a hint, then the answer


@needs_script
@pytest.mark.slow
def test_a_reward_function_in_the_working_folder_is_found_by_its_name(tiny_model_dir, tmp_path):
    work = tmp_path / "mywork"
    work.mkdir()
    (work / "rewards.py").write_text(REWARD)
    rows = _run(work, tiny_model_dir, "--model.reward_funcs=[rewards.has_digit]")
    logged = [float(r["reward/has_digit/mean"]) for r in rows if r.get("reward/has_digit/mean") not in (None, "")]
    assert len(logged) == 1 and 0.0 <= logged[0] <= 1.0  # its reward, logged by its name
    assert [float(r["reward/has_digit/errors"]) for r in rows if r.get("reward/has_digit/errors")] == [0.0]


def test_the_working_folder_goes_first_on_the_path_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/somewhere/bin", "/site-packages"])
    working_folder_importable()
    assert sys.path == [str(tmp_path), "/somewhere/bin", "/site-packages"]
    working_folder_importable()
    assert sys.path.count(str(tmp_path)) == 1
    monkeypatch.setattr(sys, "path", ["", "/site-packages"])  # (python -m: the working folder as "")
    working_folder_importable()
    assert sys.path == ["", "/site-packages"]


@needs_script
@pytest.mark.slow
def test_the_readmes_own_environment_runs_as_written_on_text_answers(tiny_model_dir, tmp_path):
    """README's "Your own environment": its my_pkg/guess.py and its YAML, as written, in a folder outside the
    repository, on a data file whose answers are text (as a JSONL file may hold them)."""
    code, config = [block.body for block in code_blocks(readme_section("### Your own environment"))]
    assert code.startswith("# my_pkg/guess.py") and "class Guess(Environment)" in code
    work = tmp_path / "mywork"
    (work / "my_pkg").mkdir(parents=True)
    (work / "my_pkg" / "__init__.py").write_text("")
    (work / "my_pkg" / "guess.py").write_text(code)
    (work / "guess.yaml").write_text(config)
    (work / "train.jsonl").write_text("".join(f'{{"question": "It is {n}.", "answer": "{n}"}}\n' for n in range(8)))
    rows = _run(work, tiny_model_dir, "--config=guess.yaml", "--data.source=scgrpo.data.FileSource",
                "--data.source.init_args.files=train.jsonl", "--model.episodes.max_turns=2",
                "--model.episodes.max_episode_tokens=40")
    (row,) = [r for r in rows if r.get("episode/turns_mean")]
    assert float(row["episode/env_errors"]) == 0.0
    # a hint, then the answer, on a text answer (the example as it was raised there: "3" % 2)
    import importlib.util

    from scgrpo.envs.base import Action, ToolCall

    spec = importlib.util.spec_from_file_location("guess", work / "my_pkg" / "guess.py")
    guess = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guess)
    env = guess.Guess()
    assert env.reset({"question": "It is 3.", "answer": "3"}, seed=0).startswith("Guess the number.")
    assert env.step(Action("hint()", ToolCall("hint"))).observation == "It is odd."
    final = env.step(Action("It is 3"))
    assert final.done and final.reward == 1.0
