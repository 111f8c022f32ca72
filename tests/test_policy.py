"""The policy (``scgrpo/policy.py``): where its passes run, the attention kernels a step's passes allow, how they
run (its :class:`PassOptions`), and the rollout backend it holds for the run."""

from __future__ import annotations

import pytest
import torch

from scgrpo.policy import PassOptions
from scgrpo.rollout.backends import CompactSampler, HFGenerateSampler, LoopSampler
from scgrpo.rollout.engine import GenerationSettings
from tests.helpers import tiny_module


def test_the_policy_keeps_one_backend_for_the_run_and_a_new_one_when_the_engine_changes(tiny_model_dir):
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    policy = module.actor
    backend = policy.sampler
    assert isinstance(backend, CompactSampler) and policy.sampler is backend
    prompts = policy.format_prompts(["What is 1 + 1?"])
    policy.sample(prompts, 2)
    (entry,) = backend.decoders.values()  # its decoder kept between rollouts, as the backend's own state
    policy.sample(prompts, 2)
    assert list(backend.decoders.values()) == [entry]
    released = []
    backend.release = lambda: released.append(True)
    policy.generation = GenerationSettings(num_generations=2, max_new_tokens=4, decode_forward="hf")
    assert isinstance(policy.sampler, LoopSampler) and released == [True]  # the old one's workspaces freed
    policy.generation = GenerationSettings(num_generations=2, max_new_tokens=4, engine="hf")
    assert isinstance(policy.sampler, HFGenerateSampler)
    assert len(policy.sample(prompts, 2).completions) == 2


def test_a_rollout_backend_named_by_import_path_is_the_users_class_and_a_wrong_path_says_so():
    from scgrpo.errors import InputError
    from scgrpo.rollout.backends import make_sampler
    from tests.plugins.naive_sampler import NaiveSampler

    assert isinstance(make_sampler(GenerationSettings(engine="tests.plugins.naive_sampler.NaiveSampler")), NaiveSampler)
    with pytest.raises(InputError, match="no such class to import"):
        make_sampler(GenerationSettings(engine="tests.plugins.nowhere.Sampler"))
    with pytest.raises(InputError, match="is not a Sampler class"):
        make_sampler(GenerationSettings(engine="tests.plugins.naive_sampler.DRAWS"))
    with pytest.raises(ValueError, match="expected 'loop', 'hf' or the import path"):
        GenerationSettings(engine="vllm")


def test_pass_options_turn_packing_off_for_this_policy_alone(tiny_model_dir):
    first, second = tiny_module(tiny_model_dir), tiny_module(tiny_model_dir)
    first.configure_model()
    second.configure_model()
    assert first.actor.packs and second.actor.packs  # (a CPU: packed)
    first.actor.passes = PassOptions(packing=False)
    assert not first.actor.packs and second.actor.packs


def test_the_policys_device_follows_its_weights():
    """A module configured on the CPU and then moved (``module.to("cuda")``) samples and scores where its weights
    are now, not where they were loaded."""
    from scgrpo.distributed import PolicyRunner
    from scgrpo.policy import Policy

    policy = Policy(PolicyRunner(torch.nn.Linear(2, 2)), None, GenerationSettings(), torch.device("cpu"))
    assert policy.device == torch.device("cpu")
    policy.model.to("meta")
    assert policy.device.type == "meta"


def test_a_steps_passes_on_a_gpu_leave_out_cudnn_attention_and_put_the_backends_back(monkeypatch):
    """cuDNN's attention plans each new shape anew (tens of ms of host time a pass): off inside the passes of a
    step on a GPU, the other kernels on, and the process's own choice back after them; on CPU nothing changes."""
    from scgrpo import policy as policy_module

    backends = torch.backends.cuda
    before = (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled())
    assert backends.cudnn_sdp_enabled()  # (PyTorch's default: allowed)
    with policy_module.attention_backends(torch.device("cuda", 0)):
        assert not backends.cudnn_sdp_enabled()
        assert backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled() and backends.math_sdp_enabled()
    assert (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled()) == before
    with policy_module.attention_backends(torch.device("cpu")):
        assert backends.cudnn_sdp_enabled()
    with policy_module.attention_backends(torch.device("cuda", 0), cudnn=True):  # (PassOptions.cudnn_attention)
        assert backends.cudnn_sdp_enabled()
    backends.enable_flash_sdp(False)  # the process's own choice stands inside, less cuDNN
    try:
        with policy_module.attention_backends(torch.device("cuda", 0)):
            assert not backends.flash_sdp_enabled() and not backends.cudnn_sdp_enabled()
            assert backends.mem_efficient_sdp_enabled()
        assert not backends.flash_sdp_enabled() and backends.cudnn_sdp_enabled()
    finally:
        backends.enable_flash_sdp(True)
