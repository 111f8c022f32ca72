"""The prompt-length policy: which rows fit the model that will sample them, decided when a split is loaded.

A prompt of ``T`` tokens is sampled into ``T + max_new_tokens`` positions, so it must leave ``max_new_tokens`` of
the model's context free. An objective with a self-teacher scores the same completion under a longer prompt: the
question under a system block that holds a verified solution (up to ``max_new_tokens`` tokens, see
:mod:`scgrpo.selfteacher`), and that view must fit the same context. Rows that do not fit are skipped and counted
before training starts, instead of reaching the sampler (which would try to allocate a ``T x T`` attention mask)
or the teacher pass (which would cut the reference away).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from scgrpo.errors import InputError
from scgrpo.chat import Prompt, is_chat, prompt_text

log = logging.getLogger(__name__)

_SENTINEL = "\x00QUESTION\x00"
_MARGIN = 8
"""Slack for tokens merged or split where a question meets the template around it"""


@dataclass(frozen=True)
class PromptFit:
    """What fitting prompts needs of the model that will sample them (the module hands it to the data module)."""

    tokenizer: object
    format_prompts: Callable[[list], list[str]]
    """Questions -> the student's prompt texts (the chat template)"""
    completion_room: int
    """Positions after the prompt that sampling may fill (``max_new_tokens``, or an episode's budget and a turn)"""
    context: Optional[int]
    """The longest sequence the model takes (None: it states none)"""
    teacher_prompts: Optional[Callable[[list], list[str]]] = None
    """Questions -> the self-teacher's prompt texts with an empty reference (None: no self-teacher)"""


@dataclass(frozen=True)
class PromptLimits:
    """Token budgets of one model and generation length (None: no limit)."""

    prompt: Optional[int]
    """Longest student prompt (the question in the chat template)"""
    teacher: Optional[int]
    """Longest self-teacher prompt with an empty reference (None: the objective has no self-teacher)"""
    why: str
    """Where ``prompt`` comes from, for the warning"""
    max_new_tokens: int
    reference: int = 0
    """Tokens kept free for the reference in the self-teacher's view"""


def prompt_limits(fit: PromptFit, max_prompt_tokens: Optional[int]) -> PromptLimits:
    """The budgets for the model ``fit`` describes: a student prompt
    gets the model's context minus ``generation.max_new_tokens`` (or ``max_prompt_tokens`` when that is smaller); a
    self-teacher prompt gets the same minus room for a reference of ``max_new_tokens``. Where ``max_new_tokens`` is
    half the context or more, that room is not kept (no prompt would fit): the teacher's view must then fit with an
    empty reference, and references are cut to fit as :class:`~scgrpo.selfteacher.SelfTeacher` describes."""
    new, context = fit.completion_room, fit.context
    if context is None:  # the model states no maximum length: only data.max_prompt_tokens, if set
        return PromptLimits(max_prompt_tokens, None, "data.max_prompt_tokens", new, 0)
    room = context - new
    if room < 1:
        raise InputError(f"generation.max_new_tokens={new} leaves no room for a prompt in the model's context of "
                         f"{context} tokens; lower max_new_tokens")
    if max_prompt_tokens is not None and max_prompt_tokens < room:
        prompt, why = max_prompt_tokens, "data.max_prompt_tokens"
    else:
        prompt, why = room, f"the model's context of {context:,} minus generation.max_new_tokens {new}"
    teacher, reference = None, 0
    if fit.teacher_prompts is not None:
        reference = new if room - new >= 1 else 0
        teacher = room - reference
    return PromptLimits(prompt, teacher, why, new, reference)


def _widest_token(tokenizer) -> int:
    """An upper bound on the bytes one token stands for (the longest vocabulary entry in UTF-8)."""
    cached = getattr(tokenizer, "_scgrpo_widest_token", None)
    if cached is None:
        cached = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)
        try:
            tokenizer._scgrpo_widest_token = cached
        except AttributeError:  # pragma: no cover - a tokenizer that takes no attributes
            pass
    return max(cached, 1)


def _token_counts(tokenizer, render: Callable[[list[Prompt]], list[str]], questions: Sequence[Prompt],
                  limit: int) -> list[int]:
    """Tokens of ``render([q])[0]`` for each question, exact where they decide against ``limit``; elsewhere an
    upper bound at most ``limit - _MARGIN``. A question of ``b`` UTF-8 bytes has at most ``b`` tokens (byte-level
    BPE and SentencePiece with byte fallback: each token covers at least one byte), so most rows are settled
    without tokenising them; the rest are tokenised in one batch inside the template rendered once around a
    sentinel, and those counted near the limit that way are rendered and counted exactly (a template may trim or
    escape its content). Lists of messages are rendered and counted exactly."""
    chats = [i for i, q in enumerate(questions) if is_chat(q)]
    if chats:  # lists of messages are rendered and counted exactly; strings as below
        counts = [0] * len(questions)
        texts = [i for i in range(len(questions)) if not is_chat(questions[i])]
        exact = tokenizer(render([questions[i] for i in chats]), add_special_tokens=False)["input_ids"]
        for i, row_ids in zip(chats, exact):
            counts[i] = len(row_ids)
        for i, n in zip(texts, _token_counts(tokenizer, render, [questions[i] for i in texts], limit) if texts else []):
            counts[i] = n
        return counts
    around = render([_SENTINEL])[0]
    if around.count(_SENTINEL) != 1:  # the template changes its content: render every row
        texts = render(list(questions))
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    head, tail = around.split(_SENTINEL)
    base = len(tokenizer(head + tail, add_special_tokens=False)["input_ids"])
    sizes = [len(q.encode("utf-8", errors="replace")) for q in questions]
    counts = [base + b for b in sizes]  # upper bounds
    widest = _widest_token(tokenizer)
    # at least bytes / widest tokens: far over the limit needs no tokenising either
    unsure = [i for i, n in enumerate(counts) if n > limit - _MARGIN and sizes[i] // widest <= limit + _MARGIN]
    if unsure:
        ids = tokenizer([head + questions[i] + tail for i in unsure], add_special_tokens=False)["input_ids"]
        for i, row_ids in zip(unsure, ids):
            counts[i] = len(row_ids)
    near = [i for i in unsure if abs(counts[i] - limit) <= _MARGIN]
    if near:
        exact = tokenizer(render([questions[i] for i in near]), add_special_tokens=False)["input_ids"]
        for i, row_ids in zip(near, exact):
            counts[i] = len(row_ids)
    return counts


def drop_long_rows(fit: PromptFit, rows: list[dict], limits: PromptLimits, where: str) -> list[dict]:
    """``rows`` without those whose prompt (or self-teacher view) does not fit ``limits``; one warning with the count
    and the longest when any is dropped, an :class:`InputError` when none is left."""
    if not rows or (limits.prompt is None and limits.teacher is None):
        return rows
    questions = [r["question"] for r in rows]
    tok = fit.tokenizer
    student = _token_counts(tok, fit.format_prompts, questions, limits.prompt or 1 << 62)
    too_long = [limits.prompt is not None and n > limits.prompt for n in student]
    render = fit.teacher_prompts
    if limits.teacher is not None:
        viewed = _token_counts(tok, render, questions, limits.teacher)  # the teacher's prompt, empty reference
        too_long = [bad or n > limits.teacher for bad, n in zip(too_long, viewed)]
    skipped = [i for i, bad in enumerate(too_long) if bad]
    if not skipped:
        return rows
    longest = max(skipped, key=lambda i: len(prompt_text(questions[i])))
    tokens = len(tok(fit.format_prompts([questions[longest]]), add_special_tokens=False)["input_ids"][0])
    what = f"the longest (id {rows[longest]['id']}) has {tokens:,} tokens"
    if limits.teacher is None:
        what += f", over the {limits.prompt:,} a prompt may have ({limits.why})"
    else:
        if tokens <= limits.prompt:  # only its self-teacher view is too long: say how long
            view = len(tok(render([questions[longest]]), add_special_tokens=False)["input_ids"][0])
            what += f" and the self-teacher's view of it {view:,} (with an empty reference)"
        what += (f"; the limits are {limits.prompt:,} for a prompt ({limits.why}) and {limits.teacher:,} for the "
                 f"self-teacher's view (which also holds a reference of up to {limits.reference} tokens)")
    if len(skipped) == len(rows):
        fix = ("raise data.max_prompt_tokens" if limits.why == "data.max_prompt_tokens" else
               "lower generation.max_new_tokens or use a model with a longer context")
        raise InputError(f"{where}: no row fits the model ({len(rows)} too long): {what}; {fix}")
    log.warning("%s: skipped %d of %d rows whose prompt is too long for the model: %s", where, len(skipped),
                len(rows), what)
    dropped = set(skipped)
    return [r for i, r in enumerate(rows) if i not in dropped]
