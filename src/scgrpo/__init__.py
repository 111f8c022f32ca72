"""scgrpo: Self-Conditioned GRPO and RLVR baselines for Hugging Face causal LMs, on PyTorch Lightning."""

import os

# PyTorch's CUDA allocator in expandable segments, unless the user configured it: a step's phases (rollout, teacher pass,
# update) each fill the memory budget in their own way, and with fixed segments the blocks one phase leaves can pin
# segments the next cannot use (an 8B-shaped QLoRA step on an H200 under a 20 GiB cap found 9 GiB reserved and unusable
# in its second rollout: benchmarks/results/bench_qwen8b_1k_20gib_fixed_segments_h200.json). Read when CUDA first allocates,
# so it has no effect where that happened before scgrpo was imported.
if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

from scgrpo.data import PromptDataModule
from scgrpo.models import LoraSettings
from scgrpo.module import RLVRModule
from scgrpo.objectives import GRPO
from scgrpo.rollout import GenerationSettings

__version__ = "0.1.0"
__all__ = ["GRPO", "GenerationSettings", "LoraSettings", "PromptDataModule", "RLVRModule", "__version__"]
