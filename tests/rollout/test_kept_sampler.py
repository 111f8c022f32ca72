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


def test_a_model_rebuilt_moved_or_cast_between_calls_gets_a_new_decoder_and_samples_as_a_fresh_one(tok):
    from peft import LoraConfig, get_peft_model

    from scgrpo.rollout.backends import make_sampler

    settings = GenerationSettings(max_new_tokens=6, cuda_graphs=False)
    ids = torch.randint(3, 100, (2, 5))
    mask = torch.ones_like(ids)

    def tokens(model, sampler=None):
        return generate_ids(model, _Tokenizer(), ids, mask, settings, greedy=True, texts=False,
                            sampler=sampler).completion_ids

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(tiny("llama", len(tok)), config).eval()
    tokens(model)  # (the kept decoder, built on adapter "default")
    decoder = kept_sampler(model, settings).decoders[model]["decoder"]
    changes = [
        lambda: (model.add_adapter("b", LoraConfig(r=4, lora_alpha=64, target_modules=["k_proj", "o_proj"],
                                                   init_lora_weights=False)), model.set_adapter("b")),
        lambda: model.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()}, assign=True),
        lambda: model.to(torch.float64),
    ]
    for change in changes:
        change()
        assert torch.equal(tokens(model), tokens(model, make_sampler(settings)))  # as a fresh sampler draws them
        rebuilt = kept_sampler(model, settings).decoders[model]["decoder"]
        assert rebuilt is not decoder
        decoder = rebuilt
    tokens(model)
    assert kept_sampler(model, settings).decoders[model]["decoder"] is decoder  # (nothing changed: kept)
