"""The sampler the public ``generate`` keeps on a model between calls: made once, reused (its workspace with it),
left behind by a copy or a pickle of the model, freed on request."""

from __future__ import annotations

import copy
import pickle

import torch

from scgrpo.rollout import GenerationSettings
from scgrpo.rollout.backends import KEPT, CompactSampler, kept_sampler, release_kept
from scgrpo.rollout.engine import generate_ids
from tests.rollout.test_compact import tiny, tok  # noqa: F401 (tok: the fixture)


class _Tokenizer:
    pad_token_id = eos_token_id = 2


def test_generate_draws_with_the_sampler_it_keeps_on_the_model_and_a_copy_starts_without(tok, monkeypatch):
    model = tiny("llama", len(tok)).eval()
    settings = GenerationSettings(max_new_tokens=4, min_new_tokens=4, cuda_graphs=False)
    ids = torch.randint(3, 100, (2, 5))
    mask = torch.ones_like(ids)
    made = []
    draw = CompactSampler.draw

    def spy(self, *args, **kwargs):
        made.append(self)
        return draw(self, *args, **kwargs)

    monkeypatch.setattr(CompactSampler, "draw", spy)
    for _ in range(2):
        out = generate_ids(model, _Tokenizer(), ids, mask, settings, texts=False)
        assert out.completion_ids.shape == (2, 4)
    assert made[0] is made[1] is kept_sampler(model, settings)  # one sampler, kept
    entry = made[0].decoders[model]
    assert "decoder" in entry and entry["samplers"]  # its workspace with it
    assert KEPT not in vars(copy.deepcopy(model)) or not vars(copy.deepcopy(model))[KEPT]
    assert not vars(pickle.loads(pickle.dumps(model)))[KEPT]  # (a pickle: empty, as a copy)
    assert KEPT not in model.state_dict() and all(KEPT not in name for name, _ in model.named_modules())
    release_kept(model)
    assert KEPT not in vars(model) and not made[0].decoders
