"""Reference choice and the verified-trajectory buffer."""

import torch

from scgrpo.data.buffer import VerifiedBuffer
from scgrpo.rollout.types import RolloutBatch
from scgrpo.selfteacher import choose_references


def _rollouts(rewards, texts, group_size=4, ids=None):
    n = len(rewards)
    completion_ids = torch.tensor([[10 + i, 2] for i in range(n)])
    return RolloutBatch(
        prompt_ids=torch.ones(n, 3, dtype=torch.long), prompt_mask=torch.ones(n, 3, dtype=torch.long),
        completion_ids=completion_ids, completion_mask=torch.ones(n, 2), truncated=torch.zeros(n, dtype=torch.bool),
        group_size=group_size, sample_ids=ids or [f"p{i // group_size}" for i in range(n)], questions=["q"] * n,
        answers=[0] * n, completions=texts, rewards=torch.tensor(rewards),
    )


def test_a_rollout_is_never_its_own_reference():
    rollouts = _rollouts([1.0, 0.0, 0.0, 0.0], ["a", "b", "c", "d"])
    refs = choose_references(rollouts, [0, 1, 2, 3], 1.0, None)
    assert refs == [[], ["a"], ["a"], ["a"]]  # the only success has no other verified rollout


def test_group_references_come_before_the_buffer_and_buffer_fills_in():
    buffer = VerifiedBuffer(4)
    buffer.add("p0", [99, 2], "old", 1.0, step=0)
    rollouts = _rollouts([1.0, 1.0, 0.0, 0.0], ["a", "b", "c", "d"])
    refs = choose_references(rollouts, [0, 1, 2, 3], 1.0, buffer)
    assert refs[0] == ["b"] and refs[1] == ["a"] and refs[2][0] in {"a", "b"}
    only = _rollouts([1.0, 0.0, 0.0, 0.0], ["a", "b", "c", "d"])
    assert choose_references(only, [0], 1.0, buffer) == [["old"]]  # no other success in the group -> buffer
    two = choose_references(only, [1], 1.0, buffer, num_references=2)
    assert sorted(two[0]) == ["a", "old"]


def test_the_buffer_never_hands_a_rollout_back_to_itself():
    buffer = VerifiedBuffer(4)
    buffer.add("p0", [10, 2], "a", 1.0, step=0)  # identical tokens to row 0 below
    rollouts = _rollouts([1.0, 0.0, 0.0, 0.0], ["a", "b", "c", "d"])
    assert choose_references(rollouts, [0], 1.0, buffer) == [[]]


def test_reference_choice_is_reproducible_under_a_seed():
    rollouts = _rollouts([1.0] * 8, list("abcdefgh"), group_size=8, ids=["p"] * 8)
    first = choose_references(rollouts, list(range(8)), 1.0, None, seed=3, step=5)
    assert first == choose_references(rollouts, list(range(8)), 1.0, None, seed=3, step=5)
    others = [choose_references(rollouts, list(range(8)), 1.0, None, seed=s, step=5) for s in range(4, 9)]
    assert any(o != first for o in others)


def test_buffer_deduplicates_caps_and_round_trips():
    buffer = VerifiedBuffer(size_per_prompt=2, max_total=3)
    buffer.add("x", [1], "one", 1.0, 0)
    buffer.add("x", [2], "two", 1.0, 1)
    buffer.add("x", [1], "one", 1.0, 2)  # duplicate: becomes the most recent
    assert [e.text for e in buffer.get("x")] == ["two", "one"] and len(buffer) == 2
    buffer.add("x", [3], "three", 1.0, 3)  # per-prompt cap drops the oldest ("two")
    assert [e.text for e in buffer.get("x")] == ["one", "three"]
    buffer.add("y", [4], "four", 1.0, 4)
    buffer.add("z", [5], "five", 1.0, 5)  # global cap 3: the prompt updated longest ago ("x") loses its oldest
    assert len(buffer) == 3 and [e.text for e in buffer.get("x")] == ["three"]
    restored = VerifiedBuffer(size_per_prompt=2, max_total=3)
    restored.load_state_dict(buffer.state_dict())
    assert restored.state_dict() == buffer.state_dict() and len(restored) == 3


def test_merging_rank_buffers_keeps_each_completion_once_in_step_order_under_the_caps():
    a, b = VerifiedBuffer(size_per_prompt=2), VerifiedBuffer(size_per_prompt=2)
    a.add("p", [1], "one", 1.0, step=1)
    a.add("p", [2], "two", 1.0, step=3)
    b.add("q", [5], "five", 1.0, step=2)
    b.add("p", [1], "one", 1.0, step=1)  # the same completion seen by both (after a resume, say)
    b.add("p", [3], "three", 1.0, step=2)
    state = VerifiedBuffer.merge_states([a.state_dict(), b.state_dict()])
    assert state["size_per_prompt"] == 2
    merged = VerifiedBuffer()
    merged.load_state_dict(state)
    # p gets [1] (step 1), [3] (step 2), [2] (step 3); the cap of 2 drops the oldest, [1]
    assert [e.token_ids for e in merged.get("p")] == [[3], [2]]
    assert [e.text for e in merged.get("q")] == ["five"]
    assert len(merged) == 3
