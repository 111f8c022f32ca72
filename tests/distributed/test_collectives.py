"""Quantities that must be global over ranks: SC-GRPO's c (c_scope="batch"), the 80/20 entropy threshold, and
the gathered values behind them; two gloo processes on CPU against one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scgrpo.distributed import gather_values
from scgrpo.objectives import SCGRPO, CreditInputs, HighEntropyGRPO
from scgrpo.selfteacher import PARTIAL, SOLVE_NONE, TeacherSignal


def _batch():
    """Two groups of G = 4: a partial-solve one (rank 0's) and a solve-none one (rank 1's)."""
    g = torch.Generator().manual_seed(0)
    divergence = torch.rand(8, 5, generator=g) ** 3  # heavy-tailed, as token KLs are
    mask = torch.ones(8, 5)
    mask[1, 3:], mask[6, 2:] = 0, 0
    signal = TeacherSignal(
        route=torch.tensor([PARTIAL] * 4 + [SOLVE_NONE] * 4),
        has_teacher=torch.tensor([True, True, True, False, True, False, True, True]),
        is_reference=torch.tensor([False] * 5 + [True] + [False] * 2),
        diversity_mask=torch.tensor([[0.0] * 5] * 4 + [[1, 1, 1, 0, 0], [0] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]),
        references=["r"] * 8, divergence=divergence * mask)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    entropy = torch.rand(8, 5, generator=g)
    return signal, mask, rewards, entropy


def _select(signal: TeacherSignal, rows: slice) -> TeacherSignal:
    return TeacherSignal(route=signal.route[rows], has_teacher=signal.has_teacher[rows],
                         is_reference=signal.is_reference[rows], diversity_mask=signal.diversity_mask[rows],
                         references=signal.references[rows], divergence=signal.divergence[rows])


def _worker(rank: int, store: str, out: dict) -> None:
    torch.set_num_threads(1)  # a forked child starts no thread pool of its own (tiny tensors: none is needed)
    # (a file store: no port to pick and bind later, which another process could take in between)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        signal, mask, rewards, entropy = _batch()
        rows = slice(4 * rank, 4 * rank + 4)
        gathered = gather_values(torch.arange(rank + 2, dtype=torch.float32) + 10 * rank)
        credit = SCGRPO().credit(CreditInputs(rewards[rows], mask[rows], 4, _select(signal, rows)))
        kept = HighEntropyGRPO(rho=0.3).token_mask(entropy[rows], mask[rows])
        out[rank] = {"gathered": gathered, "weights": credit.token_weights, "advantages": credit.advantages,
                     "c": credit.stats.c, "kept": kept}
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_with_one_process_on_the_whole_batch(tmp_path):
    manager = mp.Manager()
    out = manager.dict()
    # forked rather than spawned: the ranks start with this process's imports instead of importing torch and
    # scgrpo afresh (seconds each)
    mp.start_processes(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True, start_method="fork")
    signal, mask, rewards, entropy = _batch()
    whole = SCGRPO().credit(CreditInputs(rewards, mask, 4, signal))
    assert torch.equal(out[0]["gathered"], torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0]))
    assert out[0]["c"] == pytest.approx(whole.stats.c) and out[1]["c"] == out[0]["c"]
    torch.testing.assert_close(torch.cat([out[0]["weights"], out[1]["weights"]]), whole.token_weights)
    torch.testing.assert_close(torch.cat([out[0]["advantages"], out[1]["advantages"]]), whole.advantages)
    kept = HighEntropyGRPO(rho=0.3).token_mask(entropy, mask)
    assert torch.equal(torch.cat([out[0]["kept"], out[1]["kept"]]), kept)
    # a per-rank threshold would have kept other tokens on this batch
    per_rank = torch.cat([HighEntropyGRPO(rho=0.3).token_mask(entropy[r], mask[r]) for r in (slice(0, 4), slice(4, 8))])
    assert not torch.equal(per_rank, kept)
    per_rank_c = torch.cat([SCGRPO().credit(CreditInputs(rewards[r], mask[r], 4, _select(signal, r))).token_weights
                            for r in (slice(0, 4), slice(4, 8))])
    assert not torch.allclose(per_rank_c, whole.token_weights)
