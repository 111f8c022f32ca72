"""scgrpo: Self-Conditioned GRPO and RLVR baselines for Hugging Face causal LMs, on PyTorch Lightning."""

import os

# PyTorch's CUDA allocator in expandable segments, unless the user configured it: a step's phases (rollout, teacher pass,
# update) each fill the memory budget in their own way, and with fixed segments the blocks one phase leaves can pin
# segments the next cannot use (an 8B-shaped QLoRA step on an H200 under a 20 GiB cap found 9 GiB reserved and unusable
# in its second rollout: benchmarks/results/bench_qwen8b_1k_20gib_fixed_segments_h200.json). Read when CUDA first allocates,
# so it has no effect where that happened before scgrpo was imported.
if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["GRPO", "GenerationSettings", "LoraSettings", "PromptDataModule", "RLVRModule", "__version__"]

EXPORTS = {"GRPO": "scgrpo.objectives", "GenerationSettings": "scgrpo.rollout", "LoraSettings": "scgrpo.models",
           "PromptDataModule": "scgrpo.data", "RLVRModule": "scgrpo.module"}
"""Where each name of ``__all__`` lives: imported when first asked for, so that ``import scgrpo.models`` (a script's
model resolution, the code sandbox's helpers) does not pay for Lightning and the trainer (about 4 s)"""

if TYPE_CHECKING:
    from scgrpo.data import PromptDataModule
    from scgrpo.models import LoraSettings
    from scgrpo.module import RLVRModule
    from scgrpo.objectives import GRPO
    from scgrpo.rollout import GenerationSettings


def __getattr__(name: str):
    import importlib

    if not name.isidentifier():
        raise AttributeError(f"module 'scgrpo' has no attribute {name!r}")
    target = EXPORTS.get(name, f"scgrpo.{name}")
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as err:
        if name in EXPORTS or err.name != target:
            raise
        raise AttributeError(f"module 'scgrpo' has no attribute {name!r}") from None
    except AttributeError as err:  # raised while the module imported: not a missing name of this package
        raise ImportError(f"importing {target} failed: {err}") from err
    # an exported name, or a subpackage reached as an attribute (``import scgrpo; scgrpo.objectives``), as the
    # eager imports allowed
    return getattr(module, name) if name in EXPORTS else module


def __dir__() -> list[str]:
    return sorted([*globals(), *EXPORTS])
