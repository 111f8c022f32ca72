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
    PYTHONPATH=src python scripts/calibrate_doors.py --candidates plain-3,shot-3 --rows 32 --samples 4   # a look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from scgrpo.data.doors import DoorsTask
from scgrpo.envs import EpisodeSettings
from scgrpo.envs.doors import INTRO, ROOM
from scgrpo.envs.runner import EpisodeRunner
from scgrpo.policy import build_policy
from scgrpo.rollout.engine import GenerationSettings

WORDINGS = {f"shots{k}": {"shots": k} for k in (0, 1, 2, 3)}
"""The task's texts (scgrpo.envs.doors INTRO and ROOM) with 0 to 3 worked rooms before the first"""
CANDIDATES = [f"{w}-{r}" for w in WORDINGS for r in (3, 4, 5)]
"""Each wording with 3, 4 and 5 rooms (the ood split: 2 rooms more, unseen door names)"""
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
    lines += ["", f"Texts (`scgrpo.envs.doors`): intro {json.dumps(INTRO)}, room {json.dumps(ROOM)}; `shotsK` puts K "
              "worked rooms before the first as chat turns; `-R`: R rooms (ood: R + 2, door names never trained on)."]
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
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    generation = GenerationSettings(num_generations=args.samples, max_new_tokens=args.max_new_tokens, temperature=1.0)
    policy = build_policy(args.model, args.dtype, None, None, torch.device(args.device), generation)
    results: dict = {}
    for name in args.candidates.split(","):
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
    print(f"chosen: {choose(results)}")


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
