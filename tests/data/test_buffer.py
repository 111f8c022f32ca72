"""The verified buffer: its caps (the prompt updated longest ago loses its oldest completion past the global one,
whatever the order in which the prompts were first seen), against an independent implementation over random adds;
its checkpoint state, and the merge of the ranks' states."""

import random

import pytest

from scgrpo.data.buffer import VerifiedBuffer


def _texts(buffer, *prompt_ids):
    return {p: [e.text for e in buffer.get(p)] for p in prompt_ids}


def test_the_global_cap_evicts_from_the_prompt_updated_longest_ago_not_the_first_inserted():
    buffer = VerifiedBuffer(size_per_prompt=4, max_total=3)
    buffer.add("a", [1], "a1", 1.0, 0)  # "a" is inserted first ...
    buffer.add("b", [2], "b1", 1.0, 1)
    buffer.add("a", [3], "a2", 1.0, 2)  # ... and updated last: "b" is now the one updated longest ago
    buffer.add("c", [4], "c1", 1.0, 3)  # 4 > 3: "b" loses its only completion
    assert len(buffer) == 3
    assert _texts(buffer, "a", "b", "c") == {"a": ["a1", "a2"], "b": [], "c": ["c1"]}
    buffer.add("d", [5], "d1", 1.0, 4)  # next: "a" (updated at step 2, before "c") loses its oldest
    assert _texts(buffer, "a", "c", "d") == {"a": ["a2"], "c": ["c1"], "d": ["d1"]}


def test_a_duplicate_counts_as_an_update_of_its_prompt():
    buffer = VerifiedBuffer(size_per_prompt=4, max_total=2)
    buffer.add("a", [1], "a1", 1.0, 0)
    buffer.add("b", [2], "b1", 1.0, 1)
    buffer.add("a", [1], "a1", 1.0, 2)  # seen again: "a" is the most recent, still one entry
    assert len(buffer) == 2
    buffer.add("c", [3], "c1", 1.0, 3)
    assert _texts(buffer, "a", "b", "c") == {"a": ["a1"], "b": [], "c": ["c1"]}


def test_a_restored_buffer_keeps_the_recency_order():
    buffer = VerifiedBuffer(size_per_prompt=4, max_total=3)
    for step, (prompt, token) in enumerate([("a", 1), ("b", 2), ("a", 3)]):
        buffer.add(prompt, [token], f"{prompt}{token}", 1.0, step)
    restored = VerifiedBuffer(size_per_prompt=4, max_total=3)
    restored.load_state_dict(buffer.state_dict())
    for live in (buffer, restored):
        live.add("c", [4], "c4", 1.0, 3)
    assert restored.state_dict() == buffer.state_dict()
    assert _texts(restored, "a", "b") == {"a": ["a1", "a3"], "b": []}


class ReferenceBuffer:
    """The buffer's rules written another way: per prompt a list, oldest first, and the clock tick of its last
    update; past the global cap the non-empty prompt with the oldest tick loses its first entry."""

    def __init__(self, per_prompt, total):
        self.per_prompt, self.total, self.lists, self.updated, self.clock = per_prompt, total, {}, {}, 0

    def add(self, prompt_id, token_ids, text, reward, step):
        if self.per_prompt == 0:
            return
        kept = [e for e in self.lists.get(prompt_id, []) if e[0] != list(token_ids)]
        self.lists[prompt_id] = (kept + [(list(token_ids), text, float(reward), int(step))])[-self.per_prompt:]
        self.clock += 1
        self.updated[prompt_id] = self.clock
        while self.total is not None and sum(map(len, self.lists.values())) > self.total:
            oldest = min((p for p, entries in self.lists.items() if entries), key=self.updated.__getitem__)
            self.lists[oldest].pop(0)

    def entries(self, prompt_id):
        return self.lists.get(prompt_id, [])


def _as_tuples(buffer, prompt_id):
    return [(e.token_ids, e.text, e.reward, e.step) for e in buffer.get(prompt_id)]


@pytest.mark.parametrize("per_prompt,total", [(0, None), (1, None), (2, None), (3, 5), (2, 3), (4, 1), (1, 0), (3, 7)])
def test_random_adds_leave_what_the_reference_buffer_leaves(per_prompt, total):
    rng = random.Random(per_prompt * 10 + (total or 0))
    buffer, reference = VerifiedBuffer(per_prompt, total), ReferenceBuffer(per_prompt, total)
    prompts = ["p0", "p1", "p2", "p3"]
    for step in range(80):
        prompt = rng.choice(prompts)
        tokens = [rng.randrange(3), rng.randrange(2)]  # six completions a prompt: duplicates come often
        reward = rng.choice([1, 0.5, 2])  # (an int is stored as a float)
        buffer.add(prompt, tokens, f"{prompt}:{tokens}", reward, step)
        reference.add(prompt, tokens, f"{prompt}:{tokens}", reward, step)
        assert len(buffer) == sum(len(reference.entries(p)) for p in prompts), step
        for p in prompts:
            assert _as_tuples(buffer, p) == reference.entries(p), (step, p)
            assert all(type(e.reward) is float and type(e.step) is int for e in buffer.get(p))
    restored = VerifiedBuffer(per_prompt, total)
    restored.load_state_dict(buffer.state_dict())
    assert len(restored) == len(buffer) and restored.state_dict() == buffer.state_dict()


def test_a_state_loaded_under_smaller_caps_keeps_what_adding_its_completions_would_keep():
    """A run resumed with smaller caps: the loaded buffer holds what the same completions, added again in the
    state's order (prompts by recency, each oldest first), would leave."""
    big = VerifiedBuffer(size_per_prompt=4, max_total=None)
    for step, (prompt, token) in enumerate([("a", 1), ("b", 2), ("a", 3), ("c", 4), ("a", 5), ("b", 6), ("c", 7)]):
        big.add(prompt, [token], f"{prompt}{token}", 1.0, step)
    for per_prompt, total in [(2, None), (4, 3), (1, 2), (0, None), (3, 0)]:
        small, replayed = VerifiedBuffer(per_prompt, total), ReferenceBuffer(per_prompt, total)
        small.load_state_dict(big.state_dict())
        for prompt, entries in big.state_dict()["entries"]:
            for e in entries:
                replayed.add(prompt, e["token_ids"], e["text"], e["reward"], e["step"])
        for p in "abc":
            assert _as_tuples(small, p) == replayed.entries(p), (per_prompt, total, p)
        assert len(small) == sum(len(replayed.entries(p)) for p in "abc") <= (total if total is not None else 12)


def test_get_returns_a_copy():
    buffer = VerifiedBuffer(size_per_prompt=2)
    buffer.add("p", [1], "one", 1.0, 0)
    buffer.get("p").clear()
    assert [e.text for e in buffer.get("p")] == ["one"] and len(buffer) == 1


def test_a_checkpoints_buffer_state_in_its_written_format_loads():
    """The state as checkpoints hold it (a literal: a rename of a key would break every saved run's resume)."""
    state = {"size_per_prompt": 2, "max_total": 3,
             "entries": [["q", [{"token_ids": [7], "text": "seven", "reward": 1.0, "step": 4}]],
                         ["p", [{"token_ids": [1], "text": "one", "reward": 1.0, "step": 2},
                                {"token_ids": [2], "text": "two", "reward": 0.5, "step": 5}]]]}
    buffer = VerifiedBuffer(size_per_prompt=2, max_total=3)
    buffer.load_state_dict(state)
    assert buffer.state_dict() == state and len(buffer) == 3
    buffer.add("r", [9], "nine", 1.0, 6)  # past max_total 3: "q", the prompt in the state's first place, loses its one
    assert [e.text for e in buffer.get("q")] == [] and len(buffer) == 3
    # the same state from two ranks: each completion once, added in step order (p's first, q's, p's second), so
    # that the merged state is the one given
    assert VerifiedBuffer.merge_states([state, state]) == state


def test_merging_rank_buffers_keeps_each_completion_once_in_step_order_under_the_caps():
    a, b = VerifiedBuffer(size_per_prompt=2), VerifiedBuffer(size_per_prompt=2)
    a.add("p", [1], "one", 1.0, step=1)
    a.add("p", [2], "two", 1.0, step=3)
    b.add("q", [5], "five", 1.0, step=2)
    b.add("p", [1], "one", 1.0, step=1)  # the same completion seen by both (after a resume, say)
    b.add("p", [3], "three", 1.0, step=2)
    state = VerifiedBuffer.merge_states([a.state_dict(), b.state_dict()])
    assert (state["size_per_prompt"], state["max_total"]) == (2, 100_000)
    merged = VerifiedBuffer()
    merged.load_state_dict(state)
    # p gets [1] (step 1), [3] (step 2), [2] (step 3); the cap of 2 drops the oldest, [1]
    assert [e.token_ids for e in merged.get("p")] == [[3], [2]]
    assert [e.text for e in merged.get("q")] == ["five"]
    assert len(merged) == 3


def test_the_merge_takes_the_first_states_caps():
    a, b = VerifiedBuffer(size_per_prompt=1, max_total=2), VerifiedBuffer(size_per_prompt=3, max_total=None)
    a.add("p", [1], "p1", 1.0, step=0)
    for step, (prompt, token) in enumerate([("p", 2), ("q", 3), ("r", 4)], start=1):
        b.add(prompt, [token], f"{prompt}{token}", 1.0, step)
    state = VerifiedBuffer.merge_states([a.state_dict(), b.state_dict()])
    assert (state["size_per_prompt"], state["max_total"]) == (1, 2)
    # in step order p1, p2 (p keeps one: p2), q3, r4 (past 2: p, updated longest ago, loses p2)
    assert state["entries"] == [["q", [{"token_ids": [3], "text": "q3", "reward": 1.0, "step": 2}]],
                                ["r", [{"token_ids": [4], "text": "r4", "reward": 1.0, "step": 3}]]]
    assert VerifiedBuffer.merge_states([b.state_dict(), a.state_dict()])["size_per_prompt"] == 3


def test_a_completion_two_ranks_hold_is_merged_as_of_its_latest_step():
    """After a resume every rank holds the merged buffer; one rank then verifies a kept completion again. The merge
    keeps it once, as the most recent: what one buffer that saw all the adds would hold."""
    a, b = VerifiedBuffer(size_per_prompt=3), VerifiedBuffer(size_per_prompt=3)
    a.add("p", [1], "one", 1.0, step=1)
    b.add("p", [1], "one", 1.0, step=1)
    b.add("p", [2], "two", 1.0, step=3)
    b.add("p", [1], "one again", 0.5, step=5)
    alone = VerifiedBuffer(size_per_prompt=3)
    for step, token, text, reward in [(1, 1, "one", 1.0), (3, 2, "two", 1.0), (5, 1, "one again", 0.5)]:
        alone.add("p", [token], text, reward, step)
    for states in ([a.state_dict(), b.state_dict()], [b.state_dict(), a.state_dict()]):
        assert VerifiedBuffer.merge_states(states) == alone.state_dict()
    assert [(e.token_ids, e.step) for e in alone.get("p")] == [([2], 3), ([1], 5)]
