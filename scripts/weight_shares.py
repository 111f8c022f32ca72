"""Where SC-GRPO's weight goes: the share of the f(D) mass on decision tokens against the rest, per route and over
training, from a run's ``credit_tokens.jsonl`` (written by ``CreditLogging`` every ``log_completions_every_n_steps``
steps: each rollout's tokens, which of them the model wrote, and their weight f; its ``step`` is the step's number
in the run's ``metrics.csv``, 0 for the first, and so are the steps here).

    python scripts/weight_shares.py runs/scgrpo/version_0 --task arith --out weights
    python scripts/weight_shares.py runs/a/version_0 runs/b/version_0 --task tool --tools calc --out weights
    python scripts/weight_shares.py runs/blackjack/version_0 --task words --words hit,stick,stand --out weights

Decision tokens (the same rules in README.md, "Where the weight goes"):

- ``arith`` and ``countdown``: a token the model wrote whose text holds a digit or an operator (``+ - * / x ÷ =``):
  the numbers and operations of the answer and of any working. Words, spaces and punctuation are the rest.
- ``tool``: a token the model wrote that overlaps a tool call: ``<tool_call>...</tool_call>`` or ``name(...)``
  for each ``--tools`` name, its arguments included. The text around the calls (and the final answer) is the
  rest. An episode's environment tokens (observations, tool results) are never counted.
- ``words``: a token the model wrote that overlaps the first of ``--words`` in its model turn (a run of tokens
  the model wrote, between the environment's), as the environment reads a move (``choose`` in
  ``scgrpo.envs.gym``): the first action word of the turn, in any case, with no letter, digit or underscore
  joined to it on either side, longer words tried first; the rest of the turn is ignored. So one turn "I hit or
  stick" marks "hit" only; a word split over tokens marks each of them. Blackjack's words are ``hit``, ``stick``
  and the forms its task reads. Everything else the model wrote is the rest.

Only rows that had a teacher count (elsewhere f is not defined: the row is plain GRPO, weight 1). Per logged step
and route, and over all steps: the decision tokens' share of the tokens and of the f mass, their ratio
(``concentration``: above 1 the weight sits on decision tokens more than uniform weights would), and the mean f
of each class. A step logged twice (a run resumed from a checkpoint) counts its last block of rows only. Writes
``<out>.json`` (with the rule's version, ``RULE_VERSION``) and ``<out>.md``, and ``<out>.png`` where matplotlib is
installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from typing import Iterable, Optional, Sequence

ARITHMETIC = re.compile(r"[0-9+\-*/×÷=]")
TOOL_TAG = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
TASKS = ("arith", "countdown", "tool", "words")
RULE_VERSION = {"arith": 1, "countdown": 1, "tool": 1, "words": 2}
"""Each rule's version, recorded with its shares; it goes up when the rule changes (see ``RULE_CHANGES``)."""
RULE_CHANGES = {("words", 2): "only the first move of each model turn counts; version 1 counted every move"}
"""What each version after the first changed."""


def tool_call_spans(text: str, names: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans of every tool call in ``text``: the ``<tool_call>`` form, and ``name(...)`` with balanced
    parentheses for each name (an unclosed call runs to the end of the text)."""
    spans = [(m.start(), m.end()) for m in TOOL_TAG.finditer(text)]
    for name in names:
        for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\s*\(", text):
            depth, end = 0, len(text)
            for k in range(m.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[k], 0)
                if depth == 0:
                    end = k + 1
                    break
            spans.append((m.start(), end))
    return spans


def move_pattern(words: Sequence[str]) -> re.Pattern:
    """The environment's pattern for a move (``scgrpo.envs.gym``'s ``choose``): any of ``words``, in any case, with
    no word character on either side, longer words tried first."""
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"(?<!\w)({alternatives})(?!\w)", re.IGNORECASE)


def word_spans(text: str, words: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans of every move (:func:`move_pattern`) in ``text``."""
    if not words:
        return []
    return [(m.start(), m.end()) for m in move_pattern(words).finditer(text)]


def model_turns(model: Sequence[int]) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of each run of consecutive tokens the model wrote (flag 1)."""
    turns, start = [], None
    for k, own in enumerate([*model, 0]):
        if own and start is None:
            start = k
        elif not own and start is not None:
            turns.append((start, k))
            start = None
    return turns


def first_move_spans(tokens: Sequence[str], words: Sequence[str], model: Sequence[int]) -> list[tuple[int, int]]:
    """Character spans, in the joined ``tokens``, of the first move of each model turn: the move the environment
    takes from that turn."""
    offsets = [0]
    for t in tokens:
        offsets.append(offsets[-1] + len(t))
    spans = []
    for a, b in model_turns(model):
        found = word_spans("".join(tokens[a:b]), words)
        if found:
            spans.append((offsets[a] + found[0][0], offsets[a] + found[0][1]))
    return spans


def decision_tokens(tokens: Sequence[str], task: str, names: Sequence[str] = (),
                    model: Optional[Sequence[int]] = None) -> list[bool]:
    """Which of a completion's tokens are decision tokens under ``task``'s rule (see the module docstring);
    ``names`` are the tool names of ``tool`` and the words of ``words``; ``model`` flags the tokens the model wrote
    (1) against the environment's (0), which ``words`` reads as turns (None: every token the model's, one turn)."""
    if task in ("arith", "countdown"):
        return [bool(ARITHMETIC.search(t)) for t in tokens]
    if task not in ("tool", "words"):
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    text = "".join(tokens)
    if task == "tool":
        spans = tool_call_spans(text, names)
    else:
        spans = first_move_spans(tokens, names, [1] * len(tokens) if model is None else model)
    out, start = [], 0
    for t in tokens:
        end = start + len(t)
        out.append(any(a < end and start < b for a, b in spans) and end > start)
        start = end
    return out


class Tally:
    """Token counts and f sums of the two classes."""

    def __init__(self) -> None:
        self.n = [0, 0]  # decision, other
        self.f = [0.0, 0.0]

    def add(self, decision: bool, f: float) -> None:
        k = 0 if decision else 1
        self.n[k] += 1
        self.f[k] += f

    def summary(self) -> dict:
        tokens, mass = sum(self.n), sum(self.f)
        token_share = self.n[0] / tokens if tokens else None
        mass_share = self.f[0] / mass if mass > 0 else None
        return {
            "tokens": tokens, "decision_tokens": self.n[0],
            "decision_token_share": token_share, "decision_f_share": mass_share,
            "concentration": mass_share / token_share if mass_share is not None and token_share else None,
            "mean_f_decision": self.f[0] / self.n[0] if self.n[0] else None,
            "mean_f_other": self.f[1] / self.n[1] if self.n[1] else None,
        }


def last_blocks(records: Iterable[dict]) -> list[dict]:
    """One file's records, keeping each step's last block: a record whose row its step has already logged starts
    the step's block again and drops the step's earlier records (a run resumed from a checkpoint logs a step again,
    perhaps with fewer rows; two batches logged at one step keep the second)."""
    blocks: dict = {}
    for r in records:
        block = blocks.setdefault(r["step"], {})
        if r["row"] in block:
            block = blocks[r["step"]] = {}
        block[r["row"]] = r
    return [r for block in blocks.values() for r in block.values()]


def read_rows(paths: Iterable[str]) -> list[dict]:
    """The logged rollouts of each run folder (or ``credit_tokens.jsonl`` file), each step's last block only (see
    :func:`last_blocks`)."""
    rows = []
    for path in paths:
        file = os.path.join(path, "credit_tokens.jsonl") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise SystemExit(f"weight_shares: {file} not found (the run logs it every log_completions_every_n_steps "
                             "steps when its objective has token weights, as SC-GRPO does)")
        with open(file) as f:
            rows += last_blocks(json.loads(line) for line in f if line.strip())
    return rows


def weight_shares(rows: Iterable[dict], task: str, names: Sequence[str] = ()) -> dict:
    """``{"rule_version": int, "by_step": {step: {route: summary}}, "overall": {route: summary}}`` (see
    :meth:`Tally.summary` and ``RULE_VERSION``); the route "pooled" pools every route."""
    by_step: dict = defaultdict(lambda: defaultdict(Tally))
    overall: dict = defaultdict(Tally)
    for row in rows:
        if not row.get("has_teacher") or row.get("f") is None:
            continue
        decisions = decision_tokens(row["tokens"], task, names, row["model"])
        for token_is_decision, own, f in zip(decisions, row["model"], row["f"]):
            if not own or f is None:
                continue
            for route in (row["route"], "pooled"):
                by_step[row["step"]][route].add(token_is_decision, f)
                overall[route].add(token_is_decision, f)
    return {"rule_version": RULE_VERSION.get(task),
            "by_step": {str(s): {r: t.summary() for r, t in sorted(v.items())} for s, v in sorted(by_step.items())},
            "overall": {r: t.summary() for r, t in sorted(overall.items())}}


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(result: dict, task: str, command: str) -> str:
    lines = [f"Decision tokens under the `{task}` rule (`scripts/weight_shares.py`). Rows with a teacher only.", "",
             "| step | route | tokens | decision token share | decision f share | concentration | mean f decision "
             "| mean f other |", "|---|---|---|---|---|---|---|---|"]
    for label, block in [("all steps", result["overall"]), *result["by_step"].items()]:
        for route, s in block.items():
            lines.append(f"| {label} | {route} | {s['tokens']} | {_fmt(s['decision_token_share'])} | "
                         f"{_fmt(s['decision_f_share'])} | {_fmt(s['concentration'])} | {_fmt(s['mean_f_decision'])} "
                         f"| {_fmt(s['mean_f_other'])} |")
    return "\n".join(lines + ["", f"Command: `{command}`", ""])


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    routes = sorted({r for block in result["by_step"].values() for r in block})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for route in routes:
        steps = [int(s) for s, block in result["by_step"].items() if route in block]
        blocks = [result["by_step"][str(s)][route] for s in steps]
        axes[0].plot(steps, [b["concentration"] for b in blocks], marker="o", label=route)
        axes[1].plot(steps, [b["mean_f_decision"] for b in blocks], marker="o", label=f"{route}: decision")
        axes[1].plot(steps, [b["mean_f_other"] for b in blocks], marker="x", linestyle="--", label=f"{route}: other")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xlabel="step", ylabel="decision f share / decision token share", title="concentration on decisions")
    axes[1].set(xlabel="step", ylabel="mean f", title="mean weight by token class")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (or credit_tokens.jsonl files)")
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--tools", default="calc", help="comma-separated tool names written name(...) (task tool)")
    parser.add_argument("--words", default="", help="comma-separated words that are decisions (task words)")
    parser.add_argument("--out", default="weight_shares", help="output prefix: <out>.json, <out>.md, <out>.png")
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    words = [w for w in args.words.split(",") if w]
    if args.task == "words" and not words:
        raise SystemExit("weight_shares: --task words needs --words (the decisions, e.g. hit,stick)")
    result = weight_shares(read_rows(args.runs), args.task, tools if args.task == "tool" else words)
    if not result["overall"]:
        raise SystemExit("weight_shares: no row with a teacher in the logged rollouts (a GRPO run has no f)")
    command = "python scripts/weight_shares.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result.update(task=args.task, tools=tools, words=words, runs=args.runs, command=command)
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(f"{args.out}.md", "w") as f:
        f.write(markdown(result, args.task, command))
    drawn = plot(result, f"{args.out}.png")
    print(f"wrote {args.out}.json, {args.out}.md" + (f", {args.out}.png" if drawn else " (no plot: matplotlib is not "
                                                                                         "installed)"))


if __name__ == "__main__":
    main()
