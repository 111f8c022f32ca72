"""Calibrates the doors task (scgrpo.envs.doors) on the untrained model before any training run uses it.

For each candidate wording and number of rooms, plays ``--rows`` fixed episodes of the id split (and the ood
split) ``--samples`` times each with the base model, as training rollouts would (T=1), and reports: per-episode
success (Avg@k), the share of rooms whose move was right, the share of turns that named a door at all, the share
of moves on the first-named door (a positional habit reads 0.5 right), and the share of groups of ``--samples``
that would be partial-solve (2 <= correct < k) and solve-none.

The rule that picks the trained candidate is fixed here, before any run: of the candidates whose id success lies
in [0.25, 0.40] with at least half of their groups partial-solve, the one whose success is nearest 0.325 (the
range's middle); none if none qualifies.

    PYTHONPATH=src python scripts/calibrate_doors.py --out benchmarks/results/credit/calibration
    PYTHONPATH=src python scripts/calibrate_doors.py --candidates shots2-3,larger1-shots3-2 --rows 32 --samples 4
    PYTHONPATH=src python scripts/calibrate_doors.py --candidates mixed --splits id \
        --write-config configs/replication/doors_mixed.yaml      # the rule mixed's candidates; set the chosen

``--write-config`` sets the chosen candidate's ``rooms``, ``ood_rooms`` (2 more), ``digits`` and ``shots`` in a
task config whose data source is a DoorsTask of the same rule (a command that chooses none leaves it as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

from scgrpo.data.doors import DoorsTask
from scgrpo.envs import EpisodeSettings
from scgrpo.envs.doors import INTRO, LARGER_ROOM, ROOM
from scgrpo.envs.runner import EpisodeRunner
from scgrpo.policy import build_policy
from scgrpo.rollout.engine import GenerationSettings

WORDINGS = {f"shots{k}": {"shots": k} for k in (0, 1, 2, 3)}
"""The rule ``named`` (scgrpo.envs.doors INTRO and ROOM) with 0 to 3 worked rooms before the first"""
WORDINGS.update({f"larger{d}-shots{k}": {"rule": "larger", "digits": d, "shots": k} for d in (1, 2) for k in (2, 3, 4)})
"""The rule ``larger`` (LARGER_ROOM): numbers of 1 or 2 digits, 2 to 4 worked rooms"""
WORDINGS.update({f"mixed{d}-shots{k}": {"rule": "mixed", "digits": d, "shots": k} for d in (1, 2) for k in (2, 4, 6, 8)})
"""The rule ``mixed``: named and larger rooms in turn (named first), 2 to 8 worked rooms"""
CANDIDATES = [f"{w}-{r}" for w in WORDINGS for r in ((3, 4, 5) if w.startswith("shots") else (2, 3))]
"""The rule named's wordings with 3, 4 and 5 rooms, the rule larger's with 2 and 3 (the ood split: 2 rooms more,
unseen door names; rule ``larger``: a digit more); ``--candidates named`` or ``larger``: those of one rule"""
SUCCESS_RANGE = (0.25, 0.40)
MIN_PARTIAL = 0.5


def task_of(candidate: str, seed: int = 1234) -> DoorsTask:
    wording, rooms = candidate.rsplit("-", 1)
    if wording not in WORDINGS:
        raise SystemExit(f"unknown candidate {candidate!r}; wordings: {sorted(WORDINGS)}")
    return DoorsTask(rooms=int(rooms), ood_rooms=int(rooms) + 2, seed=seed, **WORDINGS[wording])


def measure(runner: EpisodeRunner, policy, rows: list[dict], samples: int, batch_rows: int) -> dict:
    """Success, moves and group routes of ``samples`` episodes of each row."""
    rewards, steps = [], []
    for start in range(0, len(rows), batch_rows):
        episodes = runner.run(policy, rows[start:start + batch_rows], samples, seed=0)
        rewards.append(episodes.rewards.float().cpu())
        steps += [step for info in episodes.infos for step in info["env"]]
    reward = torch.cat(rewards).view(-1, samples)  # [rows, samples]
    correct = (reward >= 1.0).sum(1)
    decided = [s for s in steps if s.get("decisions")]
    right = sum(s["decisions"][0]["correct"] for s in decided)
    return {
        "rows": reward.shape[0], "samples": samples,
        "success": float(reward.mean()), "pass": float((correct > 0).float().mean()),
        "right_moves": right / max(len(steps), 1), "moves": len(decided) / max(len(steps), 1),
        "first_named": (sum(s["move"] is not None and s["move"] == s["doors"][0] for s in decided)
                        / max(len(decided), 1)),
        "partial_groups": float(((correct >= 2) & (correct < samples)).float().mean()),
        "solve_none_groups": float((correct == 0).float().mean()),
    }


def choose(results: dict) -> str | None:
    """The selection rule of the module docstring."""
    middle = sum(SUCCESS_RANGE) / 2
    fits = [(abs(m["success"] - middle), name) for name, splits in results.items() for m in [splits.get("id")]
            if m and SUCCESS_RANGE[0] <= m["success"] <= SUCCESS_RANGE[1] and m["partial_groups"] >= MIN_PARTIAL]
    return min(fits)[1] if fits else None


def table(results: dict, chosen: str | None, command: str) -> str:
    lines = [f"# Doors task: the untrained model's calibration\n\n`{command}`\n",
             f"Selection rule (fixed before the runs): of the candidates whose id success lies in "
             f"[{SUCCESS_RANGE[0]}, {SUCCESS_RANGE[1]}] with at least {MIN_PARTIAL:.0%} of their groups partial-solve, "
             f"the one nearest {sum(SUCCESS_RANGE) / 2:.3f}. "
             f"Chosen: **{chosen or 'none'}**.\n",
             "| candidate | split | episodes | success (Avg@k) | Pass@k | right moves | a door named | first-named door | "
             "partial-solve groups | solve-none groups |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, splits in results.items():
        for split, m in splits.items():
            lines.append(f"| {name} | {split} | {m['rows']} x {m['samples']} | {m['success']:.3f} | {m['pass']:.2f} | "
                         f"{m['right_moves']:.3f} | {m['moves']:.3f} | {m['first_named']:.3f} | "
                         f"{m['partial_groups']:.2f} | {m['solve_none_groups']:.2f} |")
    lines += ["", f"Texts (`scgrpo.envs.doors`): intro {json.dumps(INTRO)}, room {json.dumps(ROOM)} (rule named) or "
              f"{json.dumps(LARGER_ROOM)} (rule larger, `largerD`: numbers of D digits); `shotsK` puts K worked rooms "
              "before the first as chat turns; `-R`: R rooms (ood: R + 2, door names never trained on, and with the "
              "rule larger a digit more)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--splits", default="id,ood")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--batch-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    parser.add_argument("--write-config", default=None, help="set the chosen candidate in this task config")
    parser.add_argument("--set-from", default=None, help="measure nothing: set the candidate a calibration's .json "
                        "chose in --write-config")
    args = parser.parse_args(argv)
    if args.set_from:
        with open(args.set_from) as f:
            chosen = json.load(f)["chosen"]
        if not chosen or not args.write_config:
            raise SystemExit(f"{args.set_from} chose {chosen!r}; --write-config: {args.write_config!r}")
        set_candidate(args.write_config, chosen)
        print(f"set {chosen} in {args.write_config}")
        return
    names = {"named": [c for c in CANDIDATES if c.startswith("shots")],
             "larger": [c for c in CANDIDATES if c.startswith("larger")],
             "mixed": [c for c in CANDIDATES if c.startswith("mixed")]}
    candidates = [c for name in args.candidates.split(",") for c in names.get(name, [name])]
    for name in candidates:
        task_of(name)  # (an unknown one stops here, before the model loads)
        if args.write_config:
            config_rule(args.write_config, name)  # (and one the config cannot take)
    torch.manual_seed(args.seed)
    generation = GenerationSettings(num_generations=args.samples, max_new_tokens=args.max_new_tokens, temperature=1.0)
    policy = build_policy(args.model, args.dtype, None, None, torch.device(args.device), generation)
    results: dict = {}
    for name in candidates:
        task = task_of(name)
        runner = EpisodeRunner(task.default_environment(), EpisodeSettings(max_turns=task.ood_rooms + 1,
                                                                 max_episode_tokens=64 * (task.ood_rooms + 1)))
        for split in args.splits.split(","):
            start = time.perf_counter()
            results.setdefault(name, {})[split] = m = measure(runner, policy, task.rows(split)[:args.rows],
                                                              args.samples, args.batch_rows)
            print(f"{name} {split}: success {m['success']:.3f}, right moves {m['right_moves']:.3f}, named "
                  f"{m['moves']:.3f}, first-named {m['first_named']:.3f}, partial {m['partial_groups']:.2f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            if args.out:
                write(args.out, results, args, argv)
    chosen = choose(results)
    print(f"chosen: {chosen}")
    if args.write_config and chosen:
        set_candidate(args.write_config, chosen)
        print(f"set {chosen} in {args.write_config}")


def candidate_settings(candidate: str) -> dict[str, int]:
    """The DoorsTask settings a candidate fixes."""
    task = task_of(candidate)
    return {"rooms": task.rooms, "ood_rooms": task.ood_rooms, "digits": task.digits, "shots": task.shots}


def config_rule(path: str, candidate: str) -> str:
    """The task config at ``path``, whose DoorsTask rule must be ``candidate``'s (else SystemExit)."""
    with open(path) as f:
        text = f.read()
    rule = task_of(candidate).rule
    if not re.search(rf"^\s+rule: {rule}\s*$", text, re.MULTILINE):
        raise SystemExit(f"{path} sets no DoorsTask rule {rule!r} (the candidate {candidate!r}'s)")
    return text


def set_candidate(path: str, candidate: str) -> None:
    """Sets ``candidate``'s settings (:func:`candidate_settings`) in the task config at ``path``: its DoorsTask's
    ``init_args`` lines (comments kept), whose ``rule`` must be the candidate's."""
    text = config_rule(path, candidate)
    for key, value in candidate_settings(candidate).items():
        text, n = re.subn(rf"^(\s+{key}): \d+\s*$", rf"\g<1>: {value}", text, count=1, flags=re.MULTILINE)
        if not n:
            raise SystemExit(f"{path} has no line '{key}: <n>' to set")
    with open(path, "w") as f:
        f.write(text)


def write(out: str, results: dict, args, argv) -> None:
    """``<out>.json`` and ``<out>.md`` with what is measured so far (rewritten after each candidate, so that a
    command stopped early keeps them)."""
    chosen = choose(results)
    command = "PYTHONPATH=src python scripts/calibrate_doors.py " + " ".join(sys.argv[1:] if argv is None else argv)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"command": command, "model": args.model, "dtype": args.dtype, "device": args.device,
                   "card": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   "rule": {"success": SUCCESS_RANGE, "min_partial": MIN_PARTIAL}, "chosen": chosen,
                   "wordings": WORDINGS, "results": results}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(table(results, chosen, command))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
