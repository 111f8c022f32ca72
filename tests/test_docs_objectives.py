"""docs/objectives.md's worked example, as written: its module in a folder of its own, its YAML, a run from that
folder; the bonus reaches every row (rule 1) and is logged."""

from __future__ import annotations

import csv
import glob
import os
import re
import sys

import pytest
import torch

from scgrpo.cli import main
from tests.test_cli_configs import BASE, _tiny_args

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "objectives.md")


def _blocks() -> tuple[str, str]:
    text = open(DOC).read().split("## A worked example", 1)[1]
    code, config = re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.S)
    return code, config


def _my_pkg() -> list[str]:
    return [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]


def test_the_worked_example_trains_on_every_row_and_logs_its_statistic(tiny_model_dir, tmp_path, monkeypatch):
    code, config = _blocks()
    assert code.startswith("# my_pkg/objectives.py")
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "objectives.py").write_text(code)
    (tmp_path / "objective.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in _my_pkg():  # (another test's my_pkg, put back after this test)
        monkeypatch.delitem(sys.modules, name)
    try:
        main(["fit", f"--config={BASE}", "--config=objective.yaml", *_tiny_args(tiny_model_dir),
              "--model.validate_before_training=false"])
    finally:  # (this test's my_pkg is not another's)
        for name in _my_pkg():
            del sys.modules[name]
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["train/rows_in_loss"]) == 1.0  # every row, zero advantage or not
        assert float(row["train/sampled_surprisal"]) > 0


def test_the_worked_examples_gradient_is_grpos_plus_the_score_function_entropy_term():
    code, _ = _blocks()
    namespace: dict = {}
    exec(compile(code, "objectives.py", "exec"), namespace)
    from scgrpo.objectives import GRPO, Credit, LossInputs

    objective, grpo = namespace["EntropyBonusGRPO"](coef=0.5), GRPO()
    assert objective.rows_in_loss(Credit(advantages=torch.tensor([0.0, 1.0])), None).tolist() == [True, True]
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    inputs = LossInputs(completion_mask=mask, advantages=torch.tensor([0.3, 0.0], dtype=torch.float64),
                        old_logprobs=lp.clone(), num_tokens=10.0)  # (these 2 rows of a batch of 10 tokens)
    ours, theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    out = objective.loss(ours, inputs)
    (grad,) = torch.autograd.grad(out.loss, ours)
    (grad_grpo,) = torch.autograd.grad(grpo.loss(theirs, inputs).loss, theirs)
    # d/d lp_t of -coef * s_t lp_t / T, s_t = -lp_t held fixed: coef * lp_t / T on the model's tokens
    torch.testing.assert_close(grad, grad_grpo + 0.5 * lp / 10.0 * mask)
    assert out.stats.extra["sampled_surprisal"].item() == pytest.approx((1 + 2 + 1.5) / 5)  # the micro-batch's mean


def test_the_score_function_term_follows_the_entropy_gradient_of_a_small_policy_exactly():
    """Over a 4-way softmax, every outcome weighed by its probability: the mean gradient of the example's bonus term
    is the gradient of the entropy (the gradient of the sampled surprisal alone would be 0)."""
    logits = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(logits, 0)
    p = logp.exp().detach()
    (entropy_grad,) = torch.autograd.grad(-(logp.exp() * logp).sum(), logits, retain_graph=True)
    (score_grad,) = torch.autograd.grad((p * (-logp.detach()) * logp).sum(), logits, retain_graph=True)
    (plain_grad,) = torch.autograd.grad((p * -logp).sum(), logits)
    torch.testing.assert_close(score_grad, entropy_grad)
    torch.testing.assert_close(plain_grad, torch.zeros_like(plain_grad))
