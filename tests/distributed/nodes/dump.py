"""A callback for the simulated nodes: each rank writes the trainable weights it ends with (whole, gathered from the
shards) to ``$SCGRPO_TEST_NODE_DIR/weights-rank<r>.pt``."""

import os

import torch
from lightning.pytorch import Callback


class DumpWeights(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        state = {name: tensor.cpu() for name, tensor in pl_module.trainable_state().items()}  # (all ranks)
        path = os.path.join(os.environ["SCGRPO_TEST_NODE_DIR"], f"weights-rank{trainer.global_rank}.pt")
        torch.save(state, path)
