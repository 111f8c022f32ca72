"""The memory budget: its sizing arithmetic, its measurements, and budgeted passes (rows sorted, packed and cut to
their spans) that give the unbudgeted numbers."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from scgrpo.policy import PassOptions
from scgrpo.objectives import GRPO, SCGRPO
from scgrpo.budget import GIB, MIN_MARGIN, TENSOR_SHARE, MemoryBudget, pack, row_extents, shape_costs
from scgrpo.update import StepSums
from tests.helpers import tiny_module
from tests.test_module import _rollouts
from tests.test_selfteacher import _sampled

QUESTIONS = ["What is 1 + 1?", "What is 23 + 4 and then what is 5 times 6 exactly?"]  # prompts of different lengths


def _cut(spans, rollouts) -> None:
    """The spans cut columns: some leave out padding before the prompts, some after the completions."""
    c = rollouts.completion_ids.shape[1]
    assert any(span.left > 0 for span in spans) and any(span.width < c for span in spans)


def test_row_extents_find_each_rows_first_prompt_token_and_last_completion_token():
    prompt = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    completion = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    first, width = row_extents(prompt, completion)
    assert first == [2, 0, 3] and width == [2, 5, 1]  # an empty completion keeps one column


def test_pack_sorts_by_length_and_fills_each_micro_batch_up_to_the_room():
    """Prompt width 10; rows (first prompt column, completion width): 0 (0, 3), 1 (2, 8), 2 (5, 1), 3 (5, 4), 4 (4, 2).
    Their own spans (10 - first + width): 13, 16, 6, 9, 8, so the order is 2, 4, 3, 0, 1. By hand, at 1 byte a padded
    token and 36 bytes of room: [2]: 1 x 6; [2,4]: 2 x (10-4+2) = 16; [2,4,3]: 3 x (10-4+4) = 30; [2,4,3,0]: 4 x
    (10-0+4) = 56 > 36, so 0 starts the next one; [0,1]: 2 x (10-0+8) = 36."""
    first, width = [0, 2, 5, 5, 4], [3, 8, 1, 4, 2]
    assert pack(first, width, 10, per_token=1.0, fixed=0.0, room=36) == [([2, 4, 3], 4, 4), ([0, 1], 0, 8)]
    # a fixed part (a block of logits) is paid by every pass: 20 bytes leave 16
    assert pack(first, width, 10, 1.0, 20.0, 36) == [([2, 4], 4, 2), ([3], 5, 4), ([0], 0, 3), ([1], 2, 8)]
    # rows per pass capped (micro_batch_size), a subset of rows, and a room that holds every row at once
    assert pack(first, width, 10, 1.0, 0.0, 1e9, max_rows=2) == [([2, 4], 4, 2), ([3, 0], 0, 4), ([1], 2, 8)]
    assert pack(first, width, 10, 1.0, 0.0, 1e9, rows=[1, 3]) == [([3, 1], 2, 8)]
    # a row too long for the room alone still gets a pass of its own
    assert pack(first, width, 10, 1.0, 0.0, 5) == [([2], 5, 1), ([4], 4, 2), ([3], 5, 4), ([0], 0, 3), ([1], 2, 8)]


@pytest.mark.parametrize("seed", range(5))
def test_pack_covers_every_row_once_within_the_room(seed):
    g = torch.Generator().manual_seed(seed)
    n, tp = 40, 16
    first = torch.randint(0, tp, (n,), generator=g).tolist()
    width = torch.randint(1, 30, (n,), generator=g).tolist()
    room, per_token, fixed = 400.0, 1.5, 10.0
    batches = pack(first, width, tp, per_token, fixed, room, max_rows=7)
    assert sorted(i for rows, _, _ in batches for i in rows) == list(range(n))
    for rows, left, w in batches:
        assert left == min(first[i] for i in rows) and w == max(width[i] for i in rows) and len(rows) <= 7
        assert len(rows) == 1 or fixed + per_token * len(rows) * (tp - left + w) <= room


def test_shape_costs_by_hand():
    """H=4, I=8, L=2, bf16: forward 1.5 x ((12 + 24) x 2 + 32 + 8) = 168; a layer kept for backward (32 + 32) x 2 + 32
    = 160, train 1.25 x 2 x 160 = 400; checkpointed 1.25 x (2 x 4 x 2 + 2 x 160) = 420 (two layers' worth plus the
    inputs: above train at two layers, far below it at thirty)."""
    config = types.SimpleNamespace(hidden_size=4, intermediate_size=8, num_hidden_layers=2)
    assert shape_costs(config, 2) == {"forward": 168.0, "train": 400.0, "train_checkpointed": 420.0}
    smollm2 = types.SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    costs = shape_costs(smollm2, 2)
    assert costs["forward"] < costs["train_checkpointed"] < costs["train"] / 5


class FakeCard:
    """torch.cuda's memory reads as a card of ``total`` bytes with ``free`` free, this process holding ``reserved``
    and ``allocated``, under a per-process ``fraction``; passes raise the peak by calling :meth:`use`."""

    def __init__(self, monkeypatch, total=80 * GIB, free=70 * GIB, reserved=2 * GIB, allocated=1 * GIB, fraction=1.0):
        self.total, self.free, self.reserved, self.allocated, self.fraction = total, free, reserved, allocated, fraction
        self.peak = allocated
        for name, fn in [("mem_get_info", lambda d=None: (self.free, self.total)),
                         ("memory_reserved", lambda d=None: self.reserved),
                         ("memory_allocated", lambda d=None: self.allocated),
                         ("max_memory_allocated", lambda d=None: self.peak),
                         ("reset_peak_memory_stats", self._reset),
                         ("get_per_process_memory_fraction", lambda d=None: self.fraction),
                         ("current_device", lambda: 0)]:
            monkeypatch.setattr(torch.cuda, name, fn, raising=False)

    def _reset(self, device=None):
        self.peak = self.allocated

    def use(self, nbytes):
        self.peak = max(self.peak, self.allocated + nbytes)


def _budget(gib=None):
    budget = MemoryBudget(gib)
    config = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100)
    budget.setup(torch.device("cuda", 0), config, torch.bfloat16)
    return budget


def test_the_default_budget_is_what_the_process_can_reach_less_a_margin(monkeypatch):
    card = FakeCard(monkeypatch)  # 70 free + 2 reserved by this process = 72 reachable; margin 5% of it
    assert _budget().total == int(72 * GIB * 0.95)
    card.fraction = 20 / 80  # set_per_process_memory_fraction(20 GiB): the cap bounds it
    assert _budget().total == 19 * GIB
    card.total, card.free, card.reserved, card.fraction = 8 * GIB, 6 * GIB, 0, 1.0  # a small card: margin 0.5 GiB
    assert _budget().total == 6 * GIB - MIN_MARGIN
    assert _budget(20.0).total == 20 * GIB  # set by the user: as given
    with pytest.raises(ValueError, match="memory_budget_gib"):
        MemoryBudget(0.0)


def test_room_and_chunk_size_follow_what_is_allocated(monkeypatch):
    card = FakeCard(monkeypatch, allocated=4 * GIB)
    budget = _budget(10.0)
    assert budget.room() == TENSOR_SHARE * 10 * GIB - 4 * GIB
    assert budget.chunk_size(1024) == 1024  # 100-entry vocabulary: blocks are small
    budget.vocab = 150_000  # 3 fp32 copies x 150k x 4 B = 1.8 MB a token; a tenth of 4.5 GiB holds 268 tokens
    assert budget.chunk_size(1024) == 256 and budget.chunk_size(1024, models=2) == 128
    card.allocated = int(8.49 * GIB)  # almost nothing left: the floor
    assert budget.chunk_size(1024) == 64


def test_a_measured_pass_replaces_the_estimate_then_raises_it(monkeypatch):
    card = FakeCard(monkeypatch)
    budget = _budget(10.0)
    estimate = budget.costs["train"]
    with budget.measure("train", tokens=1000, fixed=2000):
        card.use(int(1000 * 0.5 * estimate) + 2000)
    assert budget.costs["train"] == pytest.approx(0.5 * estimate)  # (peak - fixed) / tokens replaces the estimate
    with budget.measure("train", tokens=1000):
        card.use(int(1000 * 0.4 * estimate))
    assert budget.costs["train"] == pytest.approx(0.5 * estimate)  # lower: kept
    with budget.measure("train", tokens=100):
        card.use(int(100 * 0.9 * estimate))
    assert budget.costs["train"] == pytest.approx(0.5 * estimate)  # too few tokens to count
    with budget.measure("train", tokens=2000):
        card.use(int(2000 * 0.6 * estimate))
    assert budget.costs["train"] == pytest.approx(0.6 * estimate)
    forward = budget.costs["forward"]
    with budget.measure("forward", tokens=1000):
        pass  # a pass whose peak stayed where it began (memory freed inside it reused)
    assert budget.costs["forward"] == pytest.approx(0.25 * forward)  # the floor: a quarter of the estimate


@pytest.fixture
def budgeted(monkeypatch):
    """Activates a module's budget on CPU (a card with nothing allocated), with ``bytes_per_token`` for every kind."""

    def activate(module, total: float, bytes_per_token: float):
        FakeCard(monkeypatch, allocated=0)
        budget = module.budget
        budget.total, budget.device, budget.vocab = int(total), torch.device("cpu"), 0
        budget.costs = {kind: bytes_per_token for kind in ("forward", "train", "train_checkpointed")}
        budget.measured = set(budget.costs)  # (the fake card's passes measure nothing: the costs stay)
        module.actor.budget = budget
        return budget

    return activate


@pytest.mark.parametrize("forced", [False, True])
def test_budgeted_update_micro_batches_give_the_unbudgeted_loss_and_gradient(forced, tiny_model_dir, budgeted,
                                                                             monkeypatch):
    """Rows sorted and packed by the budget, each micro-batch cut to its span, against one pass over whole rows: the
    same loss and gradients within fp32 rounding (cutting padding columns changes summation lengths); ``forced``:
    each micro-batch's sequences also run packed end to end."""
    packed = _packings(monkeypatch, forced)
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(aggregation="seq-mean-token-mean"))
    module.configure_model()
    module.actor.passes = PassOptions(packing=forced)
    module.manual_backward = lambda loss: loss.backward()
    rollouts = _sampled(module, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], QUESTIONS)
    params = [p for p in module.policy.parameters() if p.requires_grad]

    def run():
        for p in params:
            p.grad = None
        update = module.policy_update()
        plan = update.plan(rollouts)
        sums = StepSums()
        update.accumulate(rollouts, plan, sums)
        return plan, sums["loss"], [p.grad.clone() for p in params]

    whole, loss, grads = run()
    assert whole.spans is None and len(whole.chunks) == 1
    width = rollouts.prompt_ids.shape[1] + rollouts.completion_ids.shape[1]
    budget = budgeted(module, total=3 * width * 1000 / TENSOR_SHARE, bytes_per_token=1000.0)  # 3 full rows a pass
    plan, budgeted_loss, budgeted_grads = run()
    assert len(plan.spans) >= 3 and sorted(torch.cat(plan.chunks).tolist()) == list(range(8))
    _cut(plan.spans, rollouts)
    first, width = row_extents(rollouts.prompt_mask, rollouts.context_mask)
    for span in plan.spans:
        rows = span.rows.tolist()
        assert span.left == min(first[i] for i in rows) and span.width == max(width[i] for i in rows)
    assert budget.chosen["update_passes"] == len(plan.spans) and budget.chosen["gradient_checkpointing"] == 0.0
    assert budgeted_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert all(p is not None for p in packed) and bool(packed) == forced
    for g, want in zip(budgeted_grads, grads):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_checkpointing_is_switched_on_when_one_row_does_not_fit_or_it_saves_passes(tiny_model_dir, budgeted, monkeypatch):
    """Room for 10 of the longest rows' tokens; 8 rows. Plain passes cost ``train`` bytes a token, checkpointed ones 1:
    100 (one row does not fit) -> checkpointing; 3 (3 plain passes or 1 checkpointed) -> checkpointing; 2 (2 plain
    passes, 1.5 x 1 < 2: update.CHECKPOINTED_PASS) -> checkpointing; 1.1 (plain: all 8 rows in 1 pass) -> none; never
    when the module says false."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    module.manual_backward = lambda loss: loss.backward()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    tp, longest = rollouts.prompt_ids.shape[1], rollouts.prompt_ids.shape[1] + 6
    budget = budgeted(module, total=10 * longest / TENSOR_SHARE, bytes_per_token=1.0)
    budget.costs["train"] = 100.0  # one row needs 100 x longest > 10 x longest of room
    module.policy_update().plan(rollouts)
    assert module.actor.checkpointing and budget.chosen["gradient_checkpointing"] == 1.0
    layers = module.actor.model.get_base_model().model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    budget.costs["train"] = 3.0  # plain: 3 rows a pass, 3 passes; checkpointed: 1 pass, and 2 x 1 < 3
    plan = module.policy_update().plan(rollouts)
    assert module.actor.checkpointing and len(plan.spans) == 1 and plan.kind == "train_checkpointed"
    budget.costs["train"] = 2.0  # plain: 5 rows a pass, 2 passes, which cost more than one checkpointed pass
    plan = module.policy_update().plan(rollouts)
    assert module.actor.checkpointing and len(plan.spans) == 1 and plan.kind == "train_checkpointed"
    from scgrpo import update as update_module

    monkeypatch.setattr(update_module, "CHECKPOINTED_PASS", 2.0)  # a checkpointed pass as dear as two plain ones
    plan = module.policy_update().plan(rollouts)
    assert not module.actor.checkpointing and len(plan.spans) == 2 and plan.kind == "train"
    monkeypatch.undo()
    budget.costs["train"] = 1.1
    plan = module.policy_update().plan(rollouts)
    assert not module.actor.checkpointing and not any(layer.gradient_checkpointing for layer in layers)
    assert len(plan.spans) == 1 and plan.kind == "train"
    module.gradient_checkpointing = False  # never: the budget does not switch it
    budget.costs["train"] = 100.0
    module.policy_update().plan(rollouts)
    assert not module.actor.checkpointing


def _packings(monkeypatch, forced: bool) -> list:
    """The packings the policy's passes plan (None: declined); ``forced``: every pass packs whatever it saves
    (:mod:`scgrpo.packing`), else every pass runs padded (none is planned)."""
    from scgrpo import packing, policy as policy_module

    plans = []

    def plan(*args, **kwargs):
        plans.append(packing.plan_packing(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(policy_module, "plan_packing", plan)
    if forced:
        monkeypatch.setattr(packing, "PACK_WIDTH", 8)
        monkeypatch.setattr(packing, "PACK_GAIN", 2.0)
    return plans  # (not forced: the callers' policies run with PassOptions(packing=False))


@pytest.mark.parametrize("forced", [False, True])
def test_budgeted_teacher_and_scoring_passes_give_the_unbudgeted_values(forced, tiny_model_dir, budgeted, monkeypatch):
    packed = _packings(monkeypatch, forced)
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO())
    module.configure_model()
    module.actor.passes = PassOptions(packing=forced)
    rollouts = _sampled(module, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], QUESTIONS)  # a partial and a solve-none group
    whole = module.run_self_teacher(rollouts).divergence
    module.actor.score(rollouts, old=True, reference=True)
    old, ref = rollouts.old_logprobs, rollouts.ref_logprobs
    entropy = module.actor.batch_entropy(rollouts, None)
    width = rollouts.prompt_ids.shape[1] + rollouts.completion_ids.shape[1]
    budget = budgeted(module, total=3 * width * 1000 / TENSOR_SHARE, bytes_per_token=1000.0)  # about 3 rows a pass
    budget.begin_step()
    cut = module.run_self_teacher(rollouts).divergence
    # under a budget each micro-batch's teacher and student rows share one forward: no pass of the student alone
    assert budget.chosen["teacher_passes"] > 1 and budget.chosen["student_passes"] != budget.chosen["student_passes"]
    mask = rollouts.completion_mask.bool()
    assert (whole[~mask] == 0).all() and (cut[~mask] == 0).all() and (whole[mask] > 0).any()
    torch.testing.assert_close(cut, whole, rtol=1e-3, atol=1e-6)
    assert all(p is not None for p in packed) and bool(packed) == forced
    packed.clear()
    module.actor.score(rollouts, old=True, reference=True)
    assert budget.chosen["scoring_passes"] > 1
    _cut(module.actor.spans("forward", rollouts), rollouts)
    torch.testing.assert_close(rollouts.old_logprobs, old, rtol=1e-5, atol=1e-5)
    assert all(p is not None for p in packed) and bool(packed) == forced
    torch.testing.assert_close(rollouts.ref_logprobs, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.actor.batch_entropy(rollouts, None), entropy, rtol=1e-5, atol=1e-5)
    assert (old[~mask] == 0).all() and (entropy[~mask] == 0).all()  # only the model's tokens are scored


def test_the_default_budget_sizes_a_rollout_that_frees_its_workspace():
    from scgrpo.rollout.engine import GenerationSettings

    freed = GenerationSettings(keep_workspace=False)
    budget = MemoryBudget()
    assert budget.rollout_settings(freed) is freed  # not resolved (CPU)
    budget.total = 19 * GIB
    assert budget.rollout_settings(freed).memory_budget_gib == pytest.approx(19.0)
    kept = GenerationSettings(keep_workspace=True)  # its recorded prefills are not counted by a budget
    assert budget.rollout_settings(kept) is kept
    own = GenerationSettings(keep_workspace=False, memory_budget_gib=12.0)
    assert budget.rollout_settings(own) is own
    given = MemoryBudget(20.0)  # a budget the run set reached the rollout when the module was built
    given.total = 20 * GIB
    assert given.rollout_settings(freed) is freed


def test_the_budget_passes_to_the_rollout_and_is_ignored_on_cpu(tiny_model_dir):
    module = tiny_module(tiny_model_dir, memory_budget_gib=12.0)
    assert module.generation.memory_budget_gib == 12.0
    module.configure_model()
    assert not module.budget.active and module.budget.metrics() == {}
    kept = tiny_module(tiny_model_dir, memory_budget_gib=12.0,
                       generation=dataclasses.replace(module.generation, memory_budget_gib=4.0))
    assert kept.generation.memory_budget_gib == 4.0  # the rollout's own setting wins


def test_micro_batch_size_caps_the_rows_of_every_budgeted_pass(tiny_model_dir, budgeted):
    """With room for every row at once, ``micro_batch_size`` still caps the rows of a pass: the update, scoring and
    teacher passes (there, a pass's teacher and student rows together: 2 x the cap sequences)."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO(), micro_batch_size=3)
    module.configure_model()
    rollouts = _sampled(module, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], QUESTIONS)
    budget = budgeted(module, total=1e12, bytes_per_token=1.0)
    budget.begin_step()
    signal = module.run_self_teacher(rollouts)
    module.actor.score(rollouts, module.objective.needs.old_logprobs, module.objective.needs.ref_logprobs)  # (GRPO defaults: nothing to score) ...
    module.actor.score(rollouts, old=True, reference=False, micro_batch_size=3)  # ... so the pass is run by hand
    plan = module.policy_update().plan(rollouts, signal)
    teacher_rows = int(signal.has_teacher.sum())
    assert budget.chosen["teacher_passes"] == -(-teacher_rows // 3)
    assert budget.chosen["scoring_passes"] == 3 and all(len(span.rows) <= 3 for span in plan.spans)
    assert budget.chosen["update_passes"] == -(-len(plan.rows) // 3)


def test_a_pass_measured_inside_a_phase_does_not_hide_the_phases_peak(monkeypatch):
    """measure() resets the allocator's peak for its pass; the phase's peak (PeakTracker.phase_peak) still holds what the
    phase reached before it."""
    card = FakeCard(monkeypatch, allocated=1 * GIB)
    budget = _budget(10.0)
    device = torch.device("cuda", 0)
    budget.peaks.phase_peak(device)  # a new phase
    card.use(5 * GIB)  # the phase's peak so far: 6 GiB
    with budget.measure("forward", tokens=1000):
        card.use(2 * GIB)  # the pass's own: 3 GiB
    assert budget.peaks.phase_peak(device) == 6 * GIB
    card.use(1 * GIB)
    assert budget.peaks.phase_peak(device) == 2 * GIB  # (the next phase starts afresh)


def test_metrics_and_the_log_line_name_the_budget_the_costs_and_the_choices(monkeypatch, caplog):
    FakeCard(monkeypatch)
    budget = _budget(10.0)
    budget.begin_step()
    budget.note("update", [4096, 1000])
    budget.chosen["gradient_checkpointing"] = 1.0
    metrics = budget.metrics()
    assert metrics["memory/budget_gib"] == 10.0 and metrics["memory/update_passes"] == 2.0
    assert metrics["memory/update_tokens_per_pass"] == 4096.0 and metrics["memory/gradient_checkpointing"] == 1.0
    assert metrics["memory/train_kib_per_token"] == budget.costs["train"] / 1024
    assert metrics["memory/teacher_passes"] != metrics["memory/teacher_passes"]  # NaN: no teacher pass this step
    with caplog.at_level("INFO", logger="scgrpo.budget"):
        budget.log_once()
        budget.log_once()
    lines = [r.getMessage() for r in caplog.records if r.name == "scgrpo.budget"]
    assert len(lines) == 1 and lines[0].startswith("memory budget 10.0 GiB (set to 10 GiB")
    assert "update passes 2" in lines[0] and "gradient checkpointing 1" in lines[0] and "teacher" not in lines[0]


# ------------------------------------------------------------------------------- a pass that runs out of memory
def _fails_over(limit: int):
    """A pass body that runs out of memory on more than ``limit`` rows, and the rows it saw succeed."""
    done: list[int] = []

    def run(rows: list[int]) -> None:
        if len(rows) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.40 GiB")
        done.extend(rows)

    return run, done


def test_a_pass_that_runs_out_of_memory_is_planned_again_in_smaller_passes(monkeypatch, caplog):
    """The cost of the failed kind becomes twice the larger of itself and what the room allows the failed pass, so
    that its rows are planned in at least two passes; the rows of the passes after it are planned with them."""
    from scgrpo.budget import run_passes

    FakeCard(monkeypatch, allocated=0)
    budget = _budget(10.0)
    budget.begin_step()
    room, per_row = budget.room(), 100  # tokens a row
    budget.costs["forward"] = room / (8 * per_row)  # the estimate: all 8 rows fit one pass
    replans = []

    def replan(rows):  # as a budget packs: as many rows a pass as the room holds at the cost now
        replans.append(list(rows))
        per_pass = max(int(room / (budget.costs["forward"] * per_row)), 1)
        return [rows[k : k + per_pass] for k in range(0, len(rows), per_pass)]

    run, done = _fails_over(1)  # (the card holds one row a pass, whatever the estimate says)
    with caplog.at_level("WARNING", logger="scgrpo.budget"):
        run_passes(budget, "forward", [[0], [1, 2, 3, 4, 5], [6, 7]], list, lambda rows: per_row * len(rows), replan, run)
    assert sorted(done) == list(range(8)) and len(done) == 8  # every row once
    assert done[0] == 0  # the passes before the failure stand
    assert replans[0] == [1, 2, 3, 4, 5, 6, 7]  # the failed pass's rows and every later pass's, planned again
    # 5 rows failed: 2 x room / 5 rows a row (above the estimate): 2 rows a pass; [1, 2] failed: room / 1 row: 1 a pass
    assert replans[1] == [1, 2, 3, 4, 5, 6, 7] and len(replans) == budget.chosen["split_passes"] == 2
    assert budget.costs["forward"] == pytest.approx(room / per_row) and "forward" in budget.measured
    warnings = [r.getMessage() for r in caplog.records if r.name == "scgrpo.budget"]
    assert len(warnings) == 1
    assert "forward pass of 5 rows (500 tokens) ran out of GPU memory within the 10.0 GiB budget" in warnings[0]
    assert budget.metrics()["memory/split_passes"] == 2.0
    budget.begin_step()
    assert budget.metrics()["memory/split_passes"] != budget.metrics()["memory/split_passes"]  # NaN: none this step


@pytest.mark.parametrize("case", ["one row", "no budget", "several ranks", "backward begun", "other error"])
def test_a_failure_that_cannot_be_split_passes_on(case, monkeypatch):
    from scgrpo import budget as budget_module

    FakeCard(monkeypatch, allocated=0)
    budget = _budget(10.0)
    run, _ = _fails_over(0 if case == "one row" else 1)
    items, undone = [[0, 1]], (lambda: True)
    if case == "one row":
        items = [[0]]
    elif case == "no budget":
        budget = None
    elif case == "several ranks":
        monkeypatch.setattr(budget_module, "world_size", lambda: 2)
    elif case == "backward begun":
        undone = lambda: False  # noqa: E731
    else:
        def run(rows):  # noqa: F811
            raise RuntimeError("a shape mismatch")
    with pytest.raises(RuntimeError):
        budget_module.run_passes(budget, "forward", items, list, len, lambda rows: [rows], run, undone)
    if budget is not None:
        assert budget.chosen.get("split_passes") is None and "forward" not in budget.measured


def _out_of_memory_over(monkeypatch, policy, limit: int) -> list[int]:
    """Every forward of the policy over more than ``limit`` sequences runs out of memory; returns the sizes seen."""
    seen: list[int] = []
    forward = type(policy).completion_hidden

    def completion_hidden(self, input_ids, *args, **kwargs):
        seen.append(input_ids.shape[0])
        if input_ids.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.40 GiB")
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(policy), "completion_hidden", completion_hidden)
    return seen


@pytest.mark.parametrize("shared", [True, False])
def test_teacher_and_scoring_passes_that_run_out_of_memory_give_the_values_of_passes_that_fit(
        shared, tiny_model_dir, budgeted, monkeypatch):
    from scgrpo.policy import PassOptions

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO())
    module.configure_model()
    module.actor.passes = PassOptions(shared_teacher_passes=shared)
    rollouts = _sampled(module, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], QUESTIONS)
    whole = module.run_self_teacher(rollouts).divergence
    module.actor.score(rollouts, old=True, reference=False)
    old = rollouts.old_logprobs
    budget = budgeted(module, total=1e12, bytes_per_token=1.0)  # room for all rows in one pass ...
    budget.begin_step()
    seen = _out_of_memory_over(monkeypatch, module.actor, 4)  # ... which the card does not have
    cut = module.run_self_teacher(rollouts).divergence
    assert max(seen) > 4 and budget.chosen["split_passes"] >= 1
    torch.testing.assert_close(cut, whole, rtol=1e-3, atol=1e-6)
    module.actor.score(rollouts, old=True, reference=False)  # planned at the raised cost (split again if need be)
    assert budget.chosen["scoring_passes"] >= 2 and max(seen[-int(budget.chosen["scoring_passes"]):]) <= 4
    torch.testing.assert_close(rollouts.old_logprobs, old, rtol=1e-5, atol=1e-5)


def test_an_update_pass_that_runs_out_of_memory_in_its_forward_is_split_and_gives_the_same_gradient(
        tiny_model_dir, budgeted, monkeypatch):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(aggregation="seq-mean-token-mean"))
    module.configure_model()
    module.manual_backward = lambda loss: loss.backward()
    rollouts = _sampled(module, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], QUESTIONS)  # every row in the loss
    rollouts.sampler_logprobs = torch.zeros_like(rollouts.completion_mask, dtype=torch.float32)  # (booked)
    params = [p for p in module.policy.parameters() if p.requires_grad]

    def run(update):
        for p in params:
            p.grad = None
        plan = update.plan(rollouts)
        sums = StepSums()
        update.accumulate(rollouts, plan, sums)
        return plan, sums["loss"], [p.grad.clone() for p in params]

    _, loss, grads = run(module.policy_update())
    budget = budgeted(module, total=1e12, bytes_per_token=1.0)
    budget.begin_step()
    seen: list[int] = []
    loss_of = type(module.objective).loss

    def loss_over_three_rows_fails(self, logprobs, inputs):  # after the pass booked its mismatch
        seen.append(len(inputs.advantages))
        if len(inputs.advantages) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.40 GiB")
        return loss_of(self, logprobs, inputs)

    monkeypatch.setattr(type(module.objective), "loss", loss_over_three_rows_fails)
    update = module.policy_update()
    plan, split_loss, split_grads = run(update)
    assert seen[0] == 8 and budget.chosen["split_passes"] >= 1 and all(len(s.rows) <= 3 for s in plan.spans)
    assert plan.num_chunks == len(plan.chunks) == len(plan.spans) == budget.chosen["update_passes"]
    # planned again as a step's passes are (checkpointing chosen again at the raised costs): kind and network agree
    assert plan.kind == ("train_checkpointed" if module.actor.checkpointing else "train")
    assert budget.chosen["gradient_checkpointing"] == float(module.actor.checkpointing)
    assert sorted(torch.cat(plan.chunks).tolist()) == list(range(8))
    assert split_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for g, want in zip(split_grads, grads):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    assert update.mismatch.tokens == float(rollouts.completion_mask.sum())  # each row's tokens booked once


def test_an_update_pass_that_runs_out_of_memory_in_its_backward_is_not_run_again(tiny_model_dir, budgeted):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO())
    module.configure_model()
    rollouts = _sampled(module, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], QUESTIONS)
    budget = budgeted(module, total=1e12, bytes_per_token=1.0)
    budget.begin_step()
    calls = []

    def backward(loss):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.40 GiB")

    module.manual_backward = backward
    update = module.policy_update()
    plan = update.plan(rollouts)
    with pytest.raises(torch.OutOfMemoryError):
        update.accumulate(rollouts, plan, StepSums())
    assert calls == [1] and budget.chosen.get("split_passes") != budget.chosen.get("split_passes")  # NaN: none
