"""Pass@k of the untrained model on a gymnasium task: how many rows it solves before training.

Plays ``--samples`` episodes of the first ``--rows`` rows of each evaluation split with the base model (no
LoRA) in the source's default environment, as validation does (rows seeded alike), and prints one table row
per split: Pass@k, Avg@k, turns and moves (valid actions) per episode, replies without a move, truncations.

    PYTHONPATH=src python scripts/calibrate_gym.py --source blackjack --rows 32 --samples 8 --max-turns 4 \\
        --max-episode-tokens 128 --max-new-tokens 16
    PYTHONPATH=src python scripts/calibrate_gym.py --source scgrpo.data.GymTask \\
        --init-args '{"env_id": "CliffWalking-v1", "actions": {"up": 0, "right": 1, "down": 2, "left": 3}}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import torch

from scgrpo.data import TASKS
from scgrpo.envs import EpisodeSettings
from scgrpo.envs.runner import EpisodeRunner
from scgrpo.policy import build_policy
from scgrpo.rollout.engine import GenerationSettings


def load_source(name: str, init_args: dict):
    if name in TASKS:
        return TASKS[name](**init_args)
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)(**init_args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="blackjack", help="a task name or a GymTask's dotted path")
    parser.add_argument("--init-args", default="{}", help="the source's arguments, as JSON")
    parser.add_argument("--splits", nargs="+", default=None)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", help="as the configs (bf16 is fast on CPUs with AMX)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="per model turn")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-episode-tokens", type=int, default=384)
    parser.add_argument("--batch-rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many episodes of the first split")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    source = load_source(args.source, json.loads(args.init_args))
    generation = GenerationSettings(num_generations=args.samples, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature)
    policy = build_policy(args.model, args.dtype, None, None, torch.device(args.device), generation)
    settings = EpisodeSettings(max_turns=args.max_turns, max_episode_tokens=args.max_episode_tokens)
    runner = EpisodeRunner(source.default_environment(), settings)
    k = args.samples
    print(f"| split | rows | Pass@{k} | Avg@{k} | turns | >1 turn | moves | >1 move | invalid replies | "
          "truncated | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, split in enumerate(args.splits or source.eval_splits()):
        rows, start = source.rows(split)[: args.rows], time.perf_counter()
        rewards, turns, moves, invalid, truncated = [], [], [], [], []
        for b in range(0, len(rows), args.batch_rows):
            played = runner.run(policy, rows[b : b + args.batch_rows], k, seed=0)
            rewards.append(played.rewards.cpu())
            truncated.append(played.truncated.float().cpu())
            turns += [info["turns"] for info in played.infos]
            invalid += [sum(bool(step.get("invalid")) for step in info["env"]) for info in played.infos]
            moves += [sum("action" in step for step in info["env"]) for info in played.infos]
            if n == 0 and b == 0:
                shown = list(zip(played.completions, played.rewards.tolist()))[: args.show * k : k]
                for text, reward in shown:
                    print(f"--- reward {reward:g}\n{text}\n")
        solved = torch.cat(rewards).view(-1, k) >= 1.0  # [rows, k]
        print(f"| {split} | {solved.shape[0]} | {solved.any(1).float().mean():.2f} | "
              f"{solved.float().mean():.3f} | "
              f"{sum(turns) / len(turns):.2f} | {sum(t > 1 for t in turns) / len(turns):.2f} | "
              f"{sum(moves) / len(moves):.2f} | {sum(m > 1 for m in moves) / len(moves):.2f} | "
              f"{sum(invalid) / sum(turns):.2f} | {torch.cat(truncated).mean():.2f} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
