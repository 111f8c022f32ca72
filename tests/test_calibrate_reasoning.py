"""scripts/calibrate_reasoning.py: Pass@k, Avg@k and the correct completions' length, by hand."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("reasoning_gym")

from tests.helpers import load_script  # noqa: E402

calibration = load_script("calibrate_reasoning")


class _Answers:
    """A stand-in model: row i's k samples are the right answer ``right[i]`` times (in tags, 50 tokens long),
    then wrong ones (10 tokens, the last cut at the cap)."""

    def __init__(self, right, rows, prose=False):
        self.right, self.rows, self.seen, self.prose = right, rows, 0, prose

    def format_prompts(self, questions):
        return questions

    def sample(self, prompts, k):
        completions, lengths, cut = [], [], []
        for _ in prompts:
            answer, n = self.rows[self.seen]["answer"]["entry"]["answer"], self.right[self.seen]
            self.seen += 1
            said = f"so it is {answer}" if self.prose else f"<answer>{answer}</answer>"
            completions += [said] * n + ["no idea"] * (k - n)
            lengths += [50] * n + [10] * (k - n)
            cut += [False] * (k - 1) + [n < k]
        return SimpleNamespace(completions=completions, completion_mask=torch.ones(len(lengths), 50) *
                               (torch.arange(50) < torch.tensor(lengths).unsqueeze(1)), truncated=torch.tensor(cut))


def test_pass_avg_and_correct_length_by_hand():
    source = calibration.ReasoningGymTask("chain_sum", {}, num_train=1, num_eval=4)
    model = _Answers([2, 0, 4, 0], source.rows("id"))
    row = calibration.calibrate(model, "chain_sum", {}, rows=4, samples=4, batch_rows=3)
    assert row["pass_at_k"] == 0.5  # rows 0 and 2
    assert row["avg_at_k"] == pytest.approx(6 / 16)
    assert row["mean_correct_length"] == 50 and row["correct"] == 6
    assert row["mean_length"] == pytest.approx((6 * 50 + 10 * 10) / 16)
    assert row["truncated"] == pytest.approx(3 / 16)  # the last sample of each row not all right
    assert calibration.suits(row)
    assert not calibration.suits({**row, "pass_at_k": 0.7}) and not calibration.suits({**row, "mean_correct_length": 30})
    assert not calibration.suits({**row, "mean_correct_length": None})


def test_answers_in_prose_count_only_with_the_lenient_extraction():
    source = calibration.ReasoningGymTask("chain_sum", {}, num_train=1, num_eval=2)
    strict = calibration.calibrate(_Answers([3, 1], source.rows("id"), prose=True), "chain_sum", {}, rows=2, samples=4)
    assert strict["correct"] == 0 and strict["extraction"] == "tag"
    lenient = calibration.calibrate(_Answers([3, 1], source.rows("id"), prose=True), "chain_sum", {}, rows=2,
                                    samples=4, extraction="tag_or_number")
    assert lenient["correct"] == 4 and lenient["pass_at_k"] == 1.0
    assert lenient["example_correct"]["completion"].startswith("so it is ")


def test_partial_credit_is_not_a_right_answer():
    class _Partly(_Answers):  # a block that holds the answer and more: the task's scorer gives partial credit
        def sample(self, prompts, k):
            out = super().sample(prompts, k)
            out.completions = [c.replace("</answer>", "0</answer>") for c in out.completions]
            return out

    source = calibration.ReasoningGymTask("chain_sum", {}, num_train=1, num_eval=2)
    row = calibration.calibrate(_Partly([4, 4], source.rows("id")), "chain_sum", {}, rows=2, samples=4)
    assert row["pass_at_k"] == 0.0 and row["avg_at_k"] == 0.0 and row["correct"] == 0
