"""scgrpo: Self-Conditioned GRPO and RLVR baselines for Hugging Face causal LMs, on PyTorch Lightning."""

from scgrpo.data import PromptDataModule
from scgrpo.models import LoraSettings
from scgrpo.module import RLVRModule
from scgrpo.objectives import GRPO
from scgrpo.rollout import GenerationSettings

__version__ = "0.1.0"
__all__ = ["GRPO", "GenerationSettings", "LoraSettings", "PromptDataModule", "RLVRModule", "__version__"]
