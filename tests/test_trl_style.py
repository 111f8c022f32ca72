"""A TRL user's data and rewards through the CLI: a conversational JSONL, plain reward functions by import path,
per-reward metrics, and the stop when every reward fails (README's example of them, run as written:
tests/test_readme_sections.py)."""

import csv
import glob
import json
import os

import pytest

from scgrpo.cli import main
from tests.test_cli_configs import BASE, _tiny_args
from tests.verifiers import reward_functions as rf

SYSTEMS = ["You answer with one word.", "You are a poet."]


def _trl_file(tmp_path) -> str:
    rows = []
    for i in range(8):
        prompt = [{"role": "user", "content": f"Name something {['red', 'green'][i % 2]} ({i})."}]
        if i % 2:
            prompt.insert(0, {"role": "system", "content": SYSTEMS[i % 4 // 2]})
        rows.append({"prompt": prompt, "topic": ["a", "b"][i % 2], "difficulty": i})
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _config(tmp_path, model_block: str) -> str:
    data = _trl_file(tmp_path)
    path = tmp_path / "trl.yaml"
    path.write_text(f"""
model:
{model_block}
data:
  source:
    class_path: scgrpo.data.FileSource
    init_args:
      files: {{train: {data}, test: {data}}}
  eval_splits: [test]
""")
    return str(path)


def _metrics(tmp_path) -> list[dict]:
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_a_conversational_dataset_with_reward_functions_trains_and_logs_each_reward(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    rf.CALLS.clear()
    config = _config(tmp_path, """  reward_funcs: [tests.verifiers.reward_functions.even_length,
                 tests.verifiers.reward_functions.mentions_topic, tests.verifiers.reward_functions.recording]
  reward_weights: [1.0, 0.5, 0.1]""")
    main(["fit", f"--config={BASE}", f"--config={config}", *_tiny_args(tiny_model_dir)])
    steps = [r for r in _metrics(tmp_path) if r.get("train/reward")]
    assert len(steps) == 2
    for row in steps:
        for name in ("even_length", "mentions_topic", "recording"):
            assert 0.0 <= float(row[f"reward/{name}/mean"]) <= 1.0 and f"reward/{name}/std" in row
            assert float(row[f"reward/{name}/errors"]) == 0.0
    # every call saw the rows' prompts as messages, their completions as assistant messages, and the other columns
    train_calls = [c for c in rf.CALLS if len(c["prompts"]) == 2 * 4]  # 2 prompts x G=4 in training
    assert train_calls
    for call in train_calls:
        assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in call["prompts"])
        assert all(c[0]["role"] == "assistant" for c in call["completions"])
        assert set(call["topic"]) <= {"a", "b"} and all(isinstance(d, int) for d in call["difficulty"])
        assert all(isinstance(ids, list) for ids in call["completion_ids"])
    # the rows' own system messages came through with their prompts (their rendering: tests/data/test_chat.py)
    systems = [p[0]["content"] for c in train_calls for p in c["prompts"] if p[0]["role"] == "system"]
    assert systems and set(systems) <= set(SYSTEMS)


def test_a_run_whose_rewards_all_fail_stops_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "  reward_funcs: [tests.verifiers.reward_functions.raises]\n"
                               "  max_reward_failure_steps: 2\n  validate_before_training: false")
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={BASE}", f"--config={config}", *_tiny_args(tiny_model_dir),
              "--trainer.max_steps=5"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("scgrpo: error:"))
    assert "every reward of the last 2 steps failed" in line and "raises ValueError: no reward today" in line
    assert "Traceback" not in err
    trained = [r for r in _metrics(tmp_path) if r.get("train/reward")] if glob.glob(
        str(tmp_path / "runs" / "*" / "version_*" / "metrics.csv")) else []
    assert len(trained) == 1  # the first failed step trained (on zeros); the second stopped before its update


def test_a_dataset_without_answers_and_a_verifier_that_needs_them_is_one_line(tiny_model_dir, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "  validate_before_training: false")
    with pytest.raises(SystemExit):
        main(["fit", f"--config={BASE}", f"--config={config}", *_tiny_args(tiny_model_dir)])
    err = capsys.readouterr().err
    assert "no column 'answer' for the answer" in err and "model.reward_funcs" in err and "Traceback" not in err


def test_verifier_and_reward_funcs_together_are_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "  reward_funcs: [tests.verifiers.reward_functions.even_length]\n"
                               "  verifier: tests.verifiers.helpers.ParityVerifier")
    with pytest.raises(SystemExit):
        main(["fit", f"--config={BASE}", f"--config={config}", *_tiny_args(tiny_model_dir)])
    assert "set model.verifier or model.reward_funcs, not both" in capsys.readouterr().err


def test_a_privileged_teacher_without_answers_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """OPSD's teacher is shown the row's answer: reward functions do not stand in for a missing answer column."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "  reward_funcs: [tests.verifiers.reward_functions.even_length]")
    opsd = os.path.join(os.path.dirname(BASE), "opsd_arith.yaml")
    with pytest.raises(SystemExit):
        main(["fit", f"--config={opsd}", f"--config={config}", *_tiny_args(tiny_model_dir)])
    err = capsys.readouterr().err
    assert "no column 'answer' for the answer" in err and "the objective's teacher reads them" in err


def test_reward_functions_with_episodes_are_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """An environment rewards its episodes itself: reward functions there would never run."""
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(BASE), "tool_calc.yaml")
    with pytest.raises(SystemExit):
        main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir),
              "--model.reward_funcs=[tests.verifiers.reward_functions.even_length]"])
    err = capsys.readouterr().err
    assert "model.reward_funcs score single completions" in err and "CalculatorEnv" in err and "Traceback" not in err
