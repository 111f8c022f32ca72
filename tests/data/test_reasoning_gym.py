"""reasoning_gym tasks as prompt rows, scored by the task's own scorer."""

import pytest

pytest.importorskip("reasoning_gym")

from scgrpo.data import ReasoningGymTask, ReasoningGymVerifier  # noqa: E402
from scgrpo.verifiers.base import VerifierSetupError  # noqa: E402


def test_splits_are_seeded_and_ood_uses_its_own_settings():
    task = ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
                            ood_config={"min_terms": 5, "max_terms": 5}, num_train=20, num_eval=8, seed=3)
    assert task.splits() == ["train", "id", "ood"]
    train, ident, ood = task.rows("train"), task.rows("id"), task.rows("ood")
    assert (len(train), len(ident), len(ood)) == (20, 8, 8)
    again = ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
                             ood_config={"min_terms": 5, "max_terms": 5}, num_train=20, num_eval=8, seed=3)
    assert [r["question"] for r in again.rows("train")] == [r["question"] for r in train]  # same seed, same rows
    assert [r["question"] for r in train[:8]] != [r["question"] for r in ident]  # id: another seed
    assert all(r["answer"]["entry"]["metadata"]["num_terms"] in (2, 3) for r in train + ident)
    assert all(r["answer"]["entry"]["metadata"]["num_terms"] == 5 for r in ood)
    assert all(r["question"].endswith("inside <answer></answer>.") for r in train)
    assert ReasoningGymTask("chain_sum", num_train=2, num_eval=2).splits() == ["train", "id"]


def test_the_tasks_own_scorer_on_the_last_answer_block():
    row = ReasoningGymTask("chain_sum", num_train=1, num_eval=4, seed=0).rows("id")[0]
    verifier = ReasoningGymVerifier()
    right = row["answer"]["entry"]["answer"]
    assert verifier.verify(f"so <answer>0</answer> no, <answer>{right}</answer>", row["answer"]).score == 1.0
    wrong = verifier.verify(f"<answer>{int(right) + 1}</answer>", row["answer"])
    assert wrong.score == 0.0 and wrong.info["extracted"] == str(int(right) + 1)
    assert verifier.verify(f"the answer is {right}", row["answer"]).score == 0.0  # no block: nothing to score
    with pytest.raises(VerifierSetupError, match="ReasoningGymTask"):
        verifier.verify("<answer>1</answer>", 1)


def test_the_answer_read_is_marked_as_the_completions_decision():
    """The span of the text scored (the last block's, stripped as reasoning_gym strips it; without a block and with
    tag_or_number, the last number), right only at full credit; nothing read, nothing marked."""
    row = ReasoningGymTask("chain_sum", num_train=1, num_eval=4, seed=0).rows("id")[0]
    right = str(row["answer"]["entry"]["answer"])
    completion = f"first <answer>0</answer> then <answer>  {right} </answer>"
    result = ReasoningGymVerifier().verify(completion, row["answer"])
    (decision,) = result.info["decisions"]
    start, end = decision["span"]
    assert completion[start:end] == right and completion.index(right, completion.rindex("<answer>")) == start
    assert decision["correct"] is True and result.score == 1.0
    wrong = f"<answer>{int(right) + 1}</answer>"
    assert ReasoningGymVerifier().verify(wrong, row["answer"]).info["decisions"] == [
        {"span": [8, 8 + len(str(int(right) + 1))], "correct": False}]
    prose = f"I think {int(right) + 2}, no: {right}."
    (decision,) = ReasoningGymVerifier("tag_or_number").verify(prose, row["answer"]).info["decisions"]
    assert prose[decision["span"][0]:decision["span"][1]] == right and decision["correct"] is True
    assert "decisions" not in ReasoningGymVerifier().verify(prose, row["answer"]).info  # no block read
    assert "decisions" not in ReasoningGymVerifier().verify("<answer></answer>", row["answer"]).info  # empty


@pytest.mark.parametrize("completion", ["<answer>7</answer>", "a <answer> 7 </answer> b <answer>\n 8\t\n</answer>",
                                        "<answer></answer>", "<answer>  </answer>", "no block 12", "<answer>x\ny</answer>",
                                        "<answer>1</answer><answer>2", "<answer> <answer>3</answer></answer>"])
def test_the_text_read_is_reasoning_gyms_own_reading(completion):
    from reasoning_gym.utils import extract_answer

    from scgrpo.data.reasoning import extract

    text, tagged, span = extract(completion)
    assert text == extract_answer(completion) and tagged == (text is not None)
    assert span is None or completion[span[0]:span[1]] == text


def test_tag_or_number_reads_the_last_number_only_without_a_block():
    row = ReasoningGymTask("chain_sum", num_train=1, num_eval=4, seed=0).rows("id")[0]
    right = int(row["answer"]["entry"]["answer"])
    lenient = ReasoningGymVerifier("tag_or_number")
    prose = lenient.verify(f"First {right + 3} - 3 gives {right}.", row["answer"])
    assert prose.score == 1.0 and prose.info["extracted"] == str(right)
    assert lenient.verify(f"It is {right}, or maybe {right + 1}", row["answer"]).score == 0.0  # the last number counts
    # a block wins over any number outside it
    assert lenient.verify(f"<answer>{right + 1}</answer> though {right}", row["answer"]).score == 0.0
    assert lenient.verify("no number at all", row["answer"]).info["extracted"] is None
    # a number that merely holds the answer's digits scores 0 (the task's scorer would give partial credit)
    assert lenient.verify(f"so {right}1", row["answer"]).score == 0.0
    assert lenient.verify(f"<answer>{right}1</answer>", row["answer"]).score == pytest.approx(len(str(right)) / len(f"{right}1"))
    assert lenient.verify(f"it is {right}.0", row["answer"]).score == 1.0  # the same number
    assert lenient.verify(f"so {right}", row["answer"]).info["from_block"] is False
    task = ReasoningGymTask("chain_sum", num_train=1, num_eval=2, extraction="tag_or_number")
    assert task.default_verifier().verify(f"so {right}", row["answer"]).score == 1.0
    assert ReasoningGymTask("chain_sum", num_train=1, num_eval=2).default_verifier().extraction == "tag"


@pytest.mark.parametrize("args, message", [
    (dict(task="chain_sum", extraction="first_number"), "extraction must be one of"),
    (dict(task="family_relationships", extraction="tag_or_number"), "reads numbers, but reasoning_gym task"),
    (dict(task="no_such_task"), "has no task 'no_such_task'"),
    (dict(task="chain_sum", config={"nonsense": 1}), "rejected the settings"),
    (dict(task="chain_sum", config={"seed": 1}), "set 'seed' on ReasoningGymTask"),
    (dict(task="chain_sum", num_eval=0), "num_eval"),
])
def test_bad_settings_fail_at_construction_with_one_clear_message(args, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymTask(**args)


def test_a_run_trains_on_a_reasoning_gym_task(tiny_model_dir, tmp_path, monkeypatch):
    """Two steps of the CLI on a reasoning_gym source (the default verifier is the task's scorer)."""
    import glob

    from scgrpo.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", f"--model.model={tiny_model_dir}", "--model.dtype=float32", "--model.generation.max_new_tokens=6",
          "--model.generation.num_generations=2", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
          "--trainer.enable_progress_bar=false", "--model.validate_before_training=false",
          "--trainer.limit_val_batches=0", "--data.batch_size=2",
          "--data.source=scgrpo.data.ReasoningGymTask", "--data.source.task=chain_sum", "--data.source.num_train=8",
          "--data.source.num_eval=4"])
    (metrics,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*" / "metrics.csv"))
    assert "train/reward" in open(metrics).readline()
