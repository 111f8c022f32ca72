"""Packed passes: the plan puts each sequence whole into one packed row, and a packed forward gives the padded
forward's states (each sequence attends to itself alone, its positions counted from its own first token)."""

from __future__ import annotations

import pytest
import torch

from scgrpo.policy import PassOptions
from scgrpo.packing import packed_inputs, plan_packing, unpack_columns
from tests.helpers import tiny_module


def _batch(prompt_lengths, completion_lengths, prompt_width=9, completion_width=7, vocab=60, seed=0):
    """Left-padded prompts then right-padded completions, ``[N, Tp + C]`` ids and mask."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_lengths)
    ids = torch.randint(3, vocab, (n, prompt_width + completion_width), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[i, prompt_width - p : prompt_width + c] = 1
    return ids.masked_fill(mask == 0, 2), mask


def test_the_plan_puts_each_sequence_whole_into_one_row_without_overlap():
    _, mask = _batch([3, 9, 5, 1, 7, 2], [7, 1, 4, 2, 6, 3])
    plan = plan_packing(mask, min_width=16, gain=1.0)
    assert plan.width == 16 and plan.rows == 4  # 50 tokens in rows of 16 columns
    assert plan.length.tolist() == mask.sum(1).tolist()
    assert plan.target.unique().numel() == plan.target.numel() == int(mask.sum())  # no two tokens in one place
    flat = torch.arange(mask.numel()).view(mask.shape)
    assert sorted(plan.source.tolist()) == flat[mask.bool()].tolist()  # every real token, once
    row_of = plan.target // plan.width
    owner = plan.owner
    assert owner.tolist() == torch.repeat_interleave(torch.arange(6), plan.length).tolist()
    for s in range(6):
        targets = plan.target[owner == s]
        assert row_of[owner == s].unique().numel() == 1  # whole in one row
        assert (targets.diff() == 1).all()  # contiguous, in order
        assert plan.positions[owner == s].tolist() == list(range(int(plan.length[s])))


def test_rows_are_filled_longest_first_and_packing_that_saves_little_is_declined():
    _, mask = _batch([9, 9, 9, 9], [7, 7, 7, 7])  # no padding at all
    assert plan_packing(mask, min_width=16) is None
    _, mask = _batch([9, 1, 1, 1], [7, 1, 1, 1])  # 16 tokens, then 3 x 2
    plan = plan_packing(mask, min_width=16, gain=1.0)
    assert plan.rows == 2 and plan.width == 16  # the longest alone fills a row; the others share the second
    assert (plan.target[plan.length[0]:] // 16 == 1).all()
    assert plan_packing(mask, min_width=16) is not None  # 32 of 64 padded tokens: saves enough ...
    assert plan_packing(mask, min_width=16, gain=0.4) is None  # ... unless it must save more
    gap = mask.clone()
    gap[0, 10] = 0  # a hole inside a row: not packed
    assert plan_packing(gap, min_width=1, gain=1.0) is None


def test_the_mask_is_causal_within_each_sequence_and_no_row_of_it_is_empty():
    ids, mask = _batch([2, 3], [1, 2], prompt_width=3, completion_width=2)
    plan = plan_packing(mask, min_width=8, gain=2.0)
    packed, positions, attend = packed_inputs(plan, ids, pad_id=2)
    assert attend.shape == (plan.rows, 1, plan.width, plan.width)
    assert packed.view(-1)[plan.target].tolist() == ids.view(-1)[plan.source].tolist()
    assert positions.view(-1)[plan.target].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # each sequence counts from 0
    assert attend.any(-1).all()  # padding sees itself: no empty row (which would give NaN)
    seq = {int(t) // plan.width * plan.width + int(t) % plan.width: s for s, t in
           zip(torch.repeat_interleave(torch.arange(2), plan.length).tolist(), plan.target.tolist())}
    flat = attend.view(plan.rows * plan.width, plan.width)
    for q, s in seq.items():
        row, col = divmod(q, plan.width)
        seen = {row * plan.width + k for k in range(plan.width) if flat[q, k]}
        assert seen == {p for p, t in seq.items() if t == s and p <= q}
    additive = packed_inputs(plan, ids, pad_id=2, mask_dtype=torch.float32)[2]
    assert ((additive == 0) == attend).all() and additive.min() == torch.finfo(torch.float32).min


def _packing_policy(tiny_model_dir, attention: str, monkeypatch):
    """The tiny module's policy and its backbone on ``attention``, packed rows of 16 columns."""
    from scgrpo import packing

    monkeypatch.setattr(packing, "PACK_WIDTH", 16)
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    backbone = module.actor.model.get_base_model().model
    backbone.config._attn_implementation = attention
    return module.actor, backbone


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_forward_gives_the_padded_forwards_states(attention, tiny_model_dir, monkeypatch):
    policy, backbone = _packing_policy(tiny_model_dir, attention, monkeypatch)
    prompts, completions = [2, 9, 2, 3, 1, 3], [7, 2, 1, 1, 3, 2]  # 36 tokens padded to 96
    ids, mask = _batch(prompts, completions)
    c = 7
    widths = []
    forward = backbone.forward

    positions = []

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape)
        positions.append(kwargs["position_ids"])
        return forward(*args, **kwargs)

    backbone.forward = spy
    with torch.no_grad():
        padded = policy.completion_hidden(ids, mask, c)
        packed = policy.completion_hidden(ids, mask, c, packed=True)
    assert widths[0] == ids.shape and widths[1][1] == 16 and widths[1][0] * 16 <= 0.8 * ids.numel()  # packed rows
    # the states before each completion token (those the passes read) agree; elsewhere the packed pass gives zeros
    want = torch.zeros(len(prompts), c, dtype=torch.bool)
    for i, k in enumerate(completions):
        want[i, :k] = True
    torch.testing.assert_close(packed[want], padded[want], rtol=1e-4, atol=1e-5)
    assert packed.abs().sum() > 0
    after = torch.zeros_like(want)  # states past a row's last token: none in the packed pass
    for i, k in enumerate(completions):
        after[i, k + 1 :] = True
    assert (packed[after] == 0).all()
    # each sequence's positions count from 0 at its own first token, wherever it lies in a packed row (RoPE's
    # states would not show an offset: the positions are checked themselves)
    plan = plan_packing(mask)
    owner = torch.repeat_interleave(torch.arange(len(prompts)), plan.length)
    got = positions[1].reshape(-1)[plan.target]
    for s_ in range(len(prompts)):
        assert got[owner == s_].tolist() == list(range(prompts[s_] + completions[s_]))
    assert (plan.target % 16 != got).any()  # (some sequence does not start a row)


def test_unpacking_reads_each_sequences_own_columns():
    _, mask = _batch([2, 3], [2, 1], prompt_width=3, completion_width=2)
    plan = plan_packing(mask, min_width=8, gain=2.0)
    hidden = torch.arange(plan.rows * plan.width, dtype=torch.float32).view(plan.rows, plan.width, 1)
    out = unpack_columns(plan, hidden, torch.arange(5))[..., 0]  # [2, 5]: each row's packed position or 0
    for s in range(2):
        first, k = int(plan.first[s]), int(plan.length[s])
        origin = int(plan.origin[s])
        assert out[s, first : first + k].tolist() == [float(origin + col) for col in range(first, first + k)]
        assert (out[s, :first] == 0).all() and (out[s, first + k :] == 0).all()


def _shared_batch():
    """Six sequences: rows 0-2 share their 5-token prompt, rows 3-4 their 3-token one, row 5 shares nothing."""
    ids, mask = _batch([5, 5, 5, 3, 3, 2], [7, 2, 4, 1, 5, 3])
    for i, j in ((1, 0), (2, 0), (4, 3)):
        ids[i, :9], mask[i, :9] = ids[j, :9], mask[j, :9]
    return ids, mask


def test_rows_that_share_their_prompt_are_packed_as_a_tree_with_the_prompt_once():
    ids, mask = _shared_batch()
    plan = plan_packing(mask, min_width=32, gain=2.0, input_ids=ids, shared_columns=9)
    assert plan.shared_tokens == 2 * 5 + 3  # two copies of the first prompt saved, one of the second
    assert plan.target.unique().numel() == int(mask.sum()) - plan.shared_tokens
    assert plan.split.tolist() == [9, 9, 9, 9, 9, 7]  # own runs start after the prompt (row 5: at its first token)
    packed, positions, attend = packed_inputs(plan, ids, pad_id=2)
    flat_ids = packed.view(-1)
    assert flat_ids[plan.target].tolist() == ids.view(-1)[plan.source].tolist()  # every token where it is read
    assert positions.view(-1)[plan.target].tolist() == plan.positions.tolist()
    # each token sees exactly the tokens before it in its own sequence, wherever they lie
    flat = attend.view(plan.rows * plan.width, plan.width)
    where = {}  # packed position -> the (sequence, offset) pairs placed there
    for s, t, o in zip(plan.owner.tolist(), plan.target.tolist(), plan.positions.tolist()):
        where.setdefault(t, set()).add((s, o))
    for t, holders in where.items():
        row = t // plan.width
        seen = {row * plan.width + k for k in range(plan.width) if flat[t, k]}
        for s, o in holders:
            assert seen == {u for u, h in where.items() if any(s2 == s and o2 <= o for s2, o2 in h)}
    assert attend.any(-1).all()


def test_a_tree_wider_than_a_row_is_cut_and_each_part_has_its_own_copy():
    ids, mask = _shared_batch()
    plan = plan_packing(mask, min_width=16, gain=2.0, input_ids=ids, shared_columns=9)
    assert plan.width == 16
    # rows 0, 2 and 1 would need 5 + 7 + 4 + 2 = 18 columns: rows 0 and 2 keep the tree, row 1 goes alone
    assert plan.split[1] == plan.first[1] and plan.split[0] == plan.split[2] == 9
    assert plan.shared_tokens == 5 + 3
    assert (plan.target // 16).max() < plan.rows


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_forward_with_shared_prompts_gives_the_padded_forwards_states_and_gradients(attention, tiny_model_dir,
                                                                                            monkeypatch):
    policy, backbone = _packing_policy(tiny_model_dir, attention, monkeypatch)
    for name, p in policy.model.named_parameters():  # LoRA's B starts at zero: give the adapters a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids, mask = _shared_batch()
    c = 7
    shapes = []
    forward = backbone.forward

    def spy(*args, **kwargs):
        shapes.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    backbone.forward = spy
    want = mask[:, 9:].bool()  # the states before each completion token
    grads = []
    for packed in (False, True):
        policy.model.zero_grad()
        hidden = policy.completion_hidden(ids, mask, c, packed=packed)
        (hidden[want].float().pow(2).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
        if packed:
            packed_hidden = hidden.detach()
        else:
            padded_hidden = hidden.detach()
    plan = plan_packing(mask, input_ids=ids, shared_columns=9)
    assert plan.shared_tokens == 5 + 3 and shapes[1] == (plan.rows, 16)  # a tree of rows 0 and 2, one of rows 3 and 4
    torch.testing.assert_close(packed_hidden[want], padded_hidden[want], rtol=1e-4, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-5)


def test_the_policys_packed_pass_shares_a_groups_prompt_and_packs_on_a_cpu(tiny_model_dir, monkeypatch):
    """The policy hands the packing its prompt columns (the rows of one prompt share them), and packs on a CPU without
    a memory budget; with packing.SHARED_PREFIXES off every row keeps its own copy."""
    from scgrpo import packing, policy as policy_module

    monkeypatch.setattr(packing, "PACK_WIDTH", 16)
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    policy = module.actor
    assert policy.budget is None or not policy.budget.active
    assert policy.packs  # a CPU: packed without a budget
    plans = []

    def spy(*args, **kwargs):
        plans.append(packing.plan_packing(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(policy_module, "plan_packing", spy)
    ids, mask = _shared_batch()
    with torch.no_grad():
        policy.completion_hidden(ids, mask, 7, packed=True)
        monkeypatch.setattr(packing, "SHARED_PREFIXES", False)
        policy.completion_hidden(ids, mask, 7, packed=True)
    assert plans[0].shared_tokens == 5 + 3 and plans[1].shared_tokens == 0
    policy.passes = PassOptions(packing=False)
    assert not policy.packs
