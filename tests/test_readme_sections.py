"""README's "Coming from TRL" and "Train an agent" sections run as written, from a folder outside the repository:
every file a section shows written there under the name it gives (``<!-- trl-example: PATH -->`` above a block, or
a first line ``# PATH``), every ``scgrpo fit`` command it shows (its ``bash`` blocks and inline code) run by the
console script in that folder, without PYTHONPATH, with only size settings appended (a tiny random model, one step
on a CPU). A command's ``--config configs/NAME.yaml`` is the shipped config (``scgrpo.cli.shipped_configs``, tested
below).

"Your own environment" (``my_pkg/guess.py`` and its YAML) runs as written in
tests/test_cli_user_modules.py::test_the_readmes_own_environment_runs_as_written_on_text_answers, and the corridor's
``my_pkg/corridor.py`` plays by hand in tests/envs/test_gym.py; its training run is here."""

from __future__ import annotations

import csv
import glob
import importlib.util
import logging
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from scgrpo.cli import SHIPPED_CONFIGS, main, shipped_configs
from tests.helpers import code_blocks, readme_section
from tests.test_cli_user_modules import SCRIPT, needs_script

REPOSITORY = Path(__file__).resolve().parents[1]
TRL = "## Coming from TRL: chat prompts and reward functions"
AGENT = "## Train an agent"


def size_settings(tiny_model_dir: str) -> list[str]:
    """What each command gets appended: sizes only, so that it runs in seconds (one step, then one evaluation)."""
    return [f"--model.model={tiny_model_dir}", "--model.dtype=float32", "--model.generation.max_new_tokens=6",
            "--model.generation.num_generations=2", "--trainer.accelerator=cpu", "--trainer.max_steps=1",
            "--trainer.val_check_interval=1", "--model.episodes.max_episode_tokens=96", "--data.batch_size=2",
            "--data.max_eval_prompts=2", "--model.validate_before_training=false",
            "--trainer.enable_progress_bar=false"]


SIZED = {flag[2:].split("=")[0] for flag in size_settings("")}


def readme_commands(text: str) -> list[str]:
    """The ``scgrpo fit`` commands of ``text`` in order: lines of its ``bash`` blocks and inline code spans."""
    commands = []
    for match in re.finditer(r"```(\w*)\n(.*?)```|`(scgrpo fit [^`]*)`", text, re.S):
        if match[3]:
            commands.append(" ".join(match[3].split()))
        elif match[1] == "bash":
            commands += [line.split(" #")[0].strip() for line in match[2].splitlines()
                         if line.startswith("scgrpo fit")]
    return commands


def section_files(heading: str) -> dict[str, str]:
    return {block.file: block.body for block in code_blocks(readme_section(heading)) if block.file}


def leaves(config: dict, prefix: str = ""):
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def assert_ran_with(block: dict, saved: dict) -> None:
    """Every setting of ``block`` (a README YAML, as loaded) is the run's own (its config.yaml), but for the sizes."""
    for key, value in leaves(block):
        if key in SIZED:
            continue
        got = saved
        for part in key.split("."):
            got = got[part]
        if isinstance(value, str) and isinstance(got, dict):  # (objective: scgrpo.objectives.SCGRPO)
            got = got["class_path"]
        assert got == value, f"{key}: README has {value!r}, the run {got!r}"


def check_trl_rewards(work: Path, saved: dict) -> None:
    spec = importlib.util.spec_from_file_location("my_rewards", work / "my_rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)  # the README's functions, scored by hand
    assert rewards.accuracy([[{"content": "so 42"}], [{"content": "none"}]], ["42", "12"]) == [1.0, 0.0]
    assert rewards.brevity([[{"content": "42"}], [{"content": "x" * 40}]]) == [1.0, 0.0]


def check_calculator_limits(work: Path, saved: dict) -> None:
    """The limits README shows for the calculator task are configs/tool_calc.yaml's."""
    (limits,) = [block for block in code_blocks(readme_section("### A calculator tool")) if block.language == "yaml"]
    assert_ran_with(yaml.safe_load(limits.body), saved)


@dataclass
class Run:
    section: str
    command: str
    train_keys: tuple[str, ...]  # what the section says is logged: each in the step's train row
    val_splits: tuple[str, ...]  # evaluated after the step
    zeros: tuple[str, ...]  # the faults among train_keys: none in README's own example
    check: object = field(default=None, repr=False)


RUNS = [
    Run(TRL, "scgrpo fit --config configs/scgrpo_arith.yaml --config trl.yaml",
        ("reward/accuracy/mean", "reward/brevity/mean", "reward/accuracy/errors", "reward/brevity/errors"),
        ("test",), ("reward/accuracy/errors", "reward/brevity/errors"), check_trl_rewards),
    Run(AGENT, "scgrpo fit --config configs/tool_calc.yaml",
        ("episode/turns_mean", "episode/model_tokens_mean", "episode/env_errors", "episode/env_timeouts"),
        ("id", "ood"), ("episode/env_errors", "episode/env_timeouts"), check_calculator_limits),
    Run(AGENT, "scgrpo fit --config configs/tool_calc.yaml --config turn_grpo.yaml",
        ("episode/turns_mean", "rollout/excluded", "rollout/skipped_groups"), ("id", "ood"), ("rollout/excluded",)),
    Run(AGENT, "scgrpo fit --config corridor.yaml", ("episode/turns_mean", "episode/env_errors"), ("id", "ood"),
        ("episode/env_errors",)),
]


def test_the_sections_show_these_files_and_commands():
    """Each command the two sections show has a run below, and each file they show has its name."""
    assert list(section_files(TRL)) == ["data/train.jsonl", "my_rewards.py", "trl.yaml"]
    assert list(section_files(AGENT)) == ["turn_grpo.yaml", "my_pkg/guess.py", "my_pkg/corridor.py", "corridor.yaml"]
    shown = [(heading, command) for heading in (TRL, AGENT) for command in readme_commands(readme_section(heading))]
    assert shown == [(run.section, run.command) for run in RUNS]


def test_commands_are_read_from_bash_blocks_and_inline_code():
    text = ("Run\n\n```bash\nscgrpo fit --config a.yaml   # a comment\necho no\n```\n\n"
            "then `scgrpo fit --config\nb.yaml` (not `scgrpo validate`).\n\n"
            "```yaml\n# `scgrpo fit --config c.yaml`\n```\n")
    assert readme_commands(text) == ["scgrpo fit --config a.yaml", "scgrpo fit --config b.yaml"]


@needs_script
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.command.removeprefix("scgrpo fit "))
def test_the_command_runs_as_written_from_a_folder_of_ones_own(run, tiny_model_dir, tmp_path):
    shown = readme_commands(readme_section(run.section))
    assert run.command in shown, f"README's {run.section!r} has no {run.command!r}, but {shown}"
    work = tmp_path / "mywork"
    assert REPOSITORY not in work.resolve().parents
    for name, body in section_files(run.section).items():  # (my_pkg as README has it: no __init__.py)
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (as a user's shell has it)
    words = shlex.split(run.command)
    done = subprocess.run([SCRIPT, *words[1:], *size_settings(tiny_model_dir)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for value in words:
        if value.startswith("configs/"):  # not in the folder: the shipped one, said once
            said = f"{value} is not in the working folder: the shipped one, {REPOSITORY / value}"
            assert done.stderr.count(said) == 1, done.stderr[-3000:]

    (folder,) = glob.glob(str(work / "runs" / "*" / "version_*"))
    rows = list(csv.DictReader(open(os.path.join(folder, "metrics.csv"))))
    (step,) = [row for row in rows if row.get("train/reward")]
    assert [key for key in run.train_keys if step.get(key) in (None, "")] == []
    assert {key: float(step[key]) for key in run.zeros} == dict.fromkeys(run.zeros, 0.0)
    for split in run.val_splits:
        assert any(row.get(f"val/{split}/avg@{k}") for row in rows for k in (2, 4)), f"no val/{split}/avg@k"
    saved = yaml.safe_load(open(os.path.join(folder, "config.yaml")))
    for name in words[words.index("fit") + 1:]:
        if name in section_files(run.section):  # a config of the section's: the run's settings
            assert_ran_with(yaml.safe_load((work / name).read_text()), saved)
    if run.check:
        run.check(work, saved)


# ---------------------------------------------------------------- --config configs/NAME.yaml from another folder
@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped configs/ folder, and a working folder without one."""
    (tmp_path / "repo" / "configs" / "sub").mkdir(parents=True)
    (tmp_path / "repo" / "configs" / "a.yaml").write_text("seed_everything: 1\n")
    (tmp_path / "repo" / "configs" / "sub" / "b.yaml").write_text("seed_everything: 2\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "repo" / "configs"


def test_a_config_under_configs_that_the_folder_lacks_is_the_shipped_one(shipped, caplog):
    with caplog.at_level(logging.INFO, logger="scgrpo.cli"):
        args = shipped_configs(["fit", "--config", "configs/a.yaml", "--config=configs/sub/b.yaml", "-c",
                                "./configs/a.yaml", "--config", "mine.yaml", "--model.model", "configs/a.yaml"],
                               shipped)
    assert args == ["fit", "--config", str(shipped / "a.yaml"), f"--config={shipped / 'sub' / 'b.yaml'}", "-c",
                    str(shipped / "a.yaml"), "--config", "mine.yaml", "--model.model", "configs/a.yaml"]
    assert caplog.messages == [f"configs/a.yaml is not in the working folder: the shipped one, {shipped / 'a.yaml'}",
                               f"configs/sub/b.yaml is not in the working folder: the shipped one, "
                               f"{shipped / 'sub' / 'b.yaml'}",
                               f"./configs/a.yaml is not in the working folder: the shipped one, "
                               f"{shipped / 'a.yaml'}"]


def test_a_config_in_the_working_folder_is_its_own(shipped, caplog):
    os.makedirs("configs")
    Path("configs/a.yaml").write_text("seed_everything: 3\n")
    args = ["fit", "--config", "configs/a.yaml", f"--config={shipped / 'a.yaml'}", "--config", "{seed_everything: 4}"]
    with caplog.at_level(logging.INFO, logger="scgrpo.cli"):
        assert shipped_configs(args, shipped) == args
    assert caplog.messages == []


def test_a_config_under_configs_found_nowhere_is_one_line(shipped, capsys):
    with pytest.raises(SystemExit) as stop:
        shipped_configs(["fit", "--config", "configs/nope.yaml"], shipped)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"scgrpo: error: no config configs/nope.yaml in the working folder "
                                       f"{shipped.parents[1] / 'work'}, nor among the configs shipped with scgrpo "
                                       f"({shipped})\n")
    with pytest.raises(SystemExit):
        shipped_configs(["fit", "-c", "configs/a.yaml"], shipped.parent / "elsewhere")
    assert capsys.readouterr().err.endswith(f"({shipped.parent / 'elsewhere'}, which this install does not have)\n")


def test_the_shipped_configs_are_the_repositorys():
    assert SHIPPED_CONFIGS == REPOSITORY / "configs" and (SHIPPED_CONFIGS / "tool_calc.yaml").is_file()


def test_main_looks_for_the_shipped_config_before_it_parses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config=configs/nope.yaml"])
    assert capsys.readouterr().err == (f"scgrpo: error: no config configs/nope.yaml in the working folder {tmp_path}, "
                                       f"nor among the configs shipped with scgrpo ({SHIPPED_CONFIGS})\n")
