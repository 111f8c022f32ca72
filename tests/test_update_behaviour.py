"""The update as seen from outside the module: what the objective is handed on each optimisation pass of a
real training step (a tiny model under a Lightning Trainer), checked against values computed here."""

import pytest
import torch
from lightning.pytorch import Callback

from scgrpo import GRPO
from tests.helpers import tiny_data, tiny_module, tiny_trainer


class RecordingGRPO(GRPO):
    """GRPO that keeps what every loss call was handed (the module does not know it is watched)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[dict] = []

    def loss(self, logprobs, inputs):
        out = super().loss(logprobs, inputs)
        self.calls.append({"logprobs": logprobs.detach().clone(), "old": inputs.old_logprobs.detach().clone(),
                           "mask": inputs.completion_mask.clone(), "advantages": inputs.advantages.clone(),
                           "loss": float(out.loss.detach())})
        return out


class BatchTokens(Callback):
    """The response tokens of each training batch, as the rollouts hold them."""

    def __init__(self) -> None:
        self.tokens: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.tokens.append(float(batch.rollouts.completion_mask.sum()))


def test_later_passes_over_a_batch_see_the_sampling_policys_logprobs_as_old(tiny_model_dir, tmp_path):
    """num_iterations = 2 on one rollout batch, lr large enough that the first update moves the policy: both
    passes get the same old log-probs, equal to the first pass's own (on-policy, no dropout); the second pass's
    log-probs differ from them, so its ratio pi_theta / pi_old is not 1, and its loss is the clipped surrogate
    of that ratio (written out here), token-mean over all the batch's response tokens."""
    torch.manual_seed(0)
    objective = RecordingGRPO(num_iterations=2)
    module = tiny_module(tiny_model_dir, objective=objective, max_grad_norm=0.0,
                         optimizer=lambda params: torch.optim.SGD(params, lr=20.0))
    tokens = BatchTokens()
    tiny_trainer(tmp_path, max_steps=2, callbacks=[tokens]).fit(module, datamodule=tiny_data())
    assert len(tokens.tokens) == 1 and len(objective.calls) == 2  # one batch, one loss call per pass
    first, second = objective.calls
    mask = first["mask"].bool()
    torch.testing.assert_close(second["old"][mask], first["old"][mask])  # pi_old stays the sampling policy
    torch.testing.assert_close(first["logprobs"][mask], first["old"][mask], atol=1e-5, rtol=1e-5)  # pass 1: ratio 1
    assert (second["logprobs"] - second["old"])[mask].abs().max() > 1e-2, "pass 2 must see pi_theta / pi_old != 1"
    ratio = torch.exp(second["logprobs"] - second["old"])  # [n, C]
    a = second["advantages"].unsqueeze(1)  # [n, 1]
    per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    expected = float((per_token * second["mask"]).sum()) / tokens.tokens[0]
    assert second["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    on_policy = float((-a * first["mask"]).sum()) / tokens.tokens[0]  # ratio 1: -A per token
    assert first["loss"] == pytest.approx(on_policy, rel=1e-4, abs=1e-7)
    assert abs(second["loss"] - first["loss"]) > 1e-4  # pass 2 is not pass 1 again
