"""How hard an environment task is for the untrained model: Pass@k, Avg@k and episode statistics per split.

Plays ``--samples`` episodes of the first ``--rows`` rows of each split with the base model (no LoRA, no training)
in the source's default environment (or ``--environment``), as a run's rollouts would, and prints one table row
per split. A task is worth training on when Pass@k lies clearly between 0 and 1.

    PYTHONPATH=src python scripts/calibrate_env.py --source tool_calc --rows 32 --samples 8
    PYTHONPATH=src python scripts/calibrate_env.py --source my_pkg.MyTask --init-args '{"level": 2}' \\
        --environment my_pkg.MyEnv --splits test
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

from scgrpo.data.sources import PromptSource
from scgrpo.data.tasks import TASKS
from scgrpo.envs import Environment, EpisodeSettings
from scgrpo.envs.runner import EpisodeRunner
from scgrpo.policy import build_policy
from scgrpo.rollout.engine import GenerationSettings


def load_class(name: str) -> type:
    """A built-in task's class by its name, or any class by its dotted path."""
    if name in TASKS:
        return TASKS[name]
    module, _, attr = name.rpartition(".")
    if not module:
        raise SystemExit(f"--source/--environment {name!r}: not a built-in task ({sorted(TASKS)}) nor a dotted path")
    return getattr(importlib.import_module(module), attr)


def measure(runner: EpisodeRunner, policy, rows: list[dict], samples: int, batch_rows: int, threshold: float) -> dict:
    """Pass@k (share of rows with a successful episode), Avg@k (mean reward), and per-episode means."""
    rewards, model_tokens, turns, truncated, calls = [], [], [], [], []
    for start in range(0, len(rows), batch_rows):
        episodes = runner.run(policy, rows[start : start + batch_rows], samples, seed=0)
        rewards.append(episodes.rewards.float().cpu())
        model_tokens.append(episodes.completion_mask.sum(1).float().cpu())
        truncated.append(episodes.truncated.float().cpu())
        turns += [info["turns"] for info in episodes.infos]
        calls += [max((step.get("tool_calls", 0) for step in info["env"]), default=0) for info in episodes.infos]
    reward = torch.cat(rewards).view(-1, samples)  # [rows, samples]
    return {
        "rows": reward.shape[0],
        "pass": float((reward >= threshold).any(1).float().mean()),
        "avg": float(reward.mean()),
        "model_tokens": float(torch.cat(model_tokens).mean()),
        "turns": sum(turns) / len(turns),
        "tool_use": sum(c > 0 for c in calls) / len(calls),
        "truncated": float(torch.cat(truncated).mean()),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="tool_calc", help="a built-in task name or a PromptSource's dotted path")
    parser.add_argument("--init-args", default="{}", help="the source's constructor arguments, as JSON")
    parser.add_argument("--environment", default=None, help="an Environment's dotted path (default: the source's)")
    parser.add_argument("--env-args", default="{}",
                        help="the environment's constructor arguments, as JSON (also for the source's default one)")
    parser.add_argument("--splits", nargs="+", default=None, help="default: the source's evaluation splits")
    parser.add_argument("--rows", type=int, default=32, help="first rows of each split")
    parser.add_argument("--samples", type=int, default=8, help="k: episodes per row")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per model turn")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-episode-tokens", type=int, default=256)
    parser.add_argument("--batch-rows", type=int, default=8, help="rows played at once (times --samples episodes)")
    parser.add_argument("--threshold", type=float, default=1.0, help="reward that counts as solved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many transcripts of the first split")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    source = load_class(args.source)(**json.loads(args.init_args))
    if not isinstance(source, PromptSource):
        raise SystemExit(f"--source {args.source!r} is not a PromptSource")
    env_args = json.loads(args.env_args)
    if args.environment is not None:
        environment = load_class(args.environment)(**env_args)
    elif callable(getattr(source, "default_environment", None)):
        environment = source.default_environment()
        if env_args:  # the default environment's class with other arguments
            environment = type(environment)(**env_args)
    else:
        raise SystemExit(f"{type(source).__name__} has no default environment; pass --environment")
    if not isinstance(environment, Environment):
        raise SystemExit(f"{type(environment).__name__} is not an Environment")
    generation = GenerationSettings(num_generations=args.samples, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature)
    policy = build_policy(args.model, args.dtype, None, None, torch.device(args.device), generation)
    runner = EpisodeRunner(environment, EpisodeSettings(max_turns=args.max_turns,
                                                        max_episode_tokens=args.max_episode_tokens))
    if args.show:
        rows = source.rows((args.splits or source.eval_splits())[0])[: args.show]
        episodes = runner.run(policy, rows, 1, seed=0)
        for text, reward in zip(episodes.completions, episodes.rewards.tolist()):
            print(f"--- reward {reward:g}\n{text}", file=sys.stderr)

    k = args.samples
    print(f"| split | rows | Pass@{k} | Avg@{k} | model tokens | turns | called the tool | truncated | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for split in args.splits or source.eval_splits():
        start = time.perf_counter()
        m = measure(runner, policy, source.rows(split)[: args.rows], k, args.batch_rows, args.threshold)
        print(f"| {split} | {m['rows']} | {m['pass']:.2f} | {m['avg']:.3f} | {m['model_tokens']:.1f} | "
              f"{m['turns']:.2f} | {m['tool_use']:.2f} | {m['truncated']:.2f} | {time.perf_counter() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
