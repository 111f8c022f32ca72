"""The verified buffer's global cap: the prompt updated longest ago loses its oldest completion, whatever the order
in which the prompts were first seen, in a live buffer and in one restored from a checkpoint."""

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
