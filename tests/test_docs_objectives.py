"""docs/objectives.md's worked example, as written: its module in a folder of its own, its YAML, a run from that
folder; the bonus reaches every row (rule 1) and is logged."""

from __future__ import annotations

import csv
import glob
import os
import re

import pytest
import torch

from scgrpo.cli import main
from tests.test_cli_configs import BASE, _tiny_args

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "objectives.md")


def _blocks() -> tuple[str, str]:
    text = open(DOC).read().split("## A worked example", 1)[1]
    code, config = re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.S)
    return code, config


def test_the_worked_example_trains_on_every_row_and_logs_its_statistic(tiny_model_dir, tmp_path, monkeypatch):
    code, config = _blocks()
    assert code.startswith("# my_pkg/objectives.py")
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "objectives.py").write_text(code)
    (tmp_path / "objective.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    main(["fit", f"--config={BASE}", "--config=objective.yaml", *_tiny_args(tiny_model_dir),
          "--model.validate_before_training=false"])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["train/rows_in_loss"]) == 1.0  # every row, zero advantage or not
        assert float(row["train/surprisal"]) > 0


def test_the_worked_examples_loss_is_grpos_minus_the_bonus_over_the_batchs_tokens():
    code, _ = _blocks()
    namespace: dict = {}
    exec(compile(code, "objectives.py", "exec"), namespace)
    from scgrpo.objectives import GRPO, Credit, LossInputs

    objective, grpo = namespace["EntropyBonusGRPO"](coef=0.5), GRPO()
    assert objective.rows_in_loss(Credit(advantages=torch.tensor([0.0, 1.0])), None).tolist() == [True, True]
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    inputs = LossInputs(completion_mask=mask, advantages=torch.tensor([0.0, 0.0], dtype=torch.float64),
                        old_logprobs=logprobs, num_tokens=10.0)  # (these 2 rows of a batch of 10 tokens)
    out = objective.loss(logprobs, inputs)
    # surprisal 1 + 2 + 0.5 x 3 = 4.5 over the batch's 10 tokens; GRPO's term is 0 on zero-advantage rows
    assert out.stats.extra["surprisal"].item() == pytest.approx(0.45)
    assert out.loss.item() == pytest.approx(grpo.loss(logprobs, inputs).loss.item() - 0.5 * 0.45)
