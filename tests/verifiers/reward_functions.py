"""Reward functions as a TRL user writes them (outside the package), chosen by import path in the tests."""

CALLS: list[dict] = []


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def even_length(completions, **kwargs):
    """1 when the completion has an even number of characters (a reward a random model can earn)."""
    return [float(len(_text(c)) % 2 == 0) for c in completions]


def mentions_topic(completions, topic, **kwargs):
    """Reads a dataset column (``topic``) by name, as TRL passes every column."""
    return [float(t in _text(c)) for c, t in zip(completions, topic)]


def recording(prompts, completions, completion_ids, **kwargs):
    """Records what it was called with; gives 0.5, and None for completions of one character or fewer."""
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [None if len(_text(c)) <= 1 else 0.5 for c in completions]


def always_none(completions, **kwargs):
    return [None] * len(completions)


def raises(completions, **kwargs):
    raise ValueError("no reward today")
