"""A training run keeps one compact decoder for its rollouts: nothing a step does (the scoring pass under the
reference with the adapters off, the self-teacher, the update) changes what the decoder was built on, so it is not
rebuilt (its CUDA graphs and compiled step re-made) at every step."""

from __future__ import annotations

import pytest

from scgrpo.objectives import GRPO, SCGRPO
from scgrpo.rollout import compact
from tests.helpers import tiny_data, tiny_module, tiny_trainer


@pytest.mark.parametrize("objective", [GRPO(beta=0.04), SCGRPO()], ids=["grpo_kl", "scgrpo"])
def test_three_steps_build_one_decoder(tiny_model_dir, tmp_path, monkeypatch, objective):
    built = []
    init = compact.CompactDecoder.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(compact.CompactDecoder, "__init__", counted)
    module = tiny_module(tiny_model_dir, objective=objective, dtype="float32")
    tiny_trainer(tmp_path, max_steps=3).fit(module, tiny_data())
    assert len(built) == 1
