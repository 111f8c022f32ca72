"""Which first message makes the calculator task learnable: the base model's Pass@k per template.

Loads the model once, plays ``--samples`` episodes of the first ``--rows`` rows of each split under every template
of ``--templates`` (a JSON object name -> template with ``{question}``), and writes the table, the JSON and a config
layer that sets the chosen template: the one whose ID Pass@k is highest (ties: more episodes that call the tool).

    python scripts/calibrate_templates.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from calibrate_env import measure  # noqa: E402

from scgrpo.data.tasks import ToolCalcTask  # noqa: E402
from scgrpo.envs import CalculatorEnv, EpisodeSettings  # noqa: E402
from scgrpo.envs.runner import EpisodeRunner  # noqa: E402
from scgrpo.policy import build_policy  # noqa: E402
from scgrpo.rollout.engine import GenerationSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--templates", default=os.path.join(ROOT, "benchmarks", "results", "agent", "templates.json"))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "agent", "calibration.json"))
    parser.add_argument("--layer", default=None, help="write the chosen template as a config layer here")
    args = parser.parse_args()
    templates = json.load(open(args.templates))
    torch.manual_seed(0)
    policy = build_policy(args.model, args.dtype, None, None, torch.device(args.device),
                          GenerationSettings(num_generations=args.samples, max_new_tokens=48, temperature=1.0))
    source = ToolCalcTask()
    results = {}
    for name, template in templates.items():
        runner = EpisodeRunner(CalculatorEnv(template=template), EpisodeSettings(max_turns=4, max_episode_tokens=256))
        start = time.perf_counter()
        results[name] = {split: measure(runner, policy, source.rows(split)[: args.rows], args.samples, args.rows, 1.0)
                         for split in ("id", "ood")}
        shown = runner.run(policy, source.rows("id")[:2], 1, seed=0)
        results[name]["example"] = shown.completions[0]
        results[name]["seconds"] = time.perf_counter() - start
        print(name, json.dumps({s: results[name][s] for s in ("id", "ood")}), flush=True)
        print("   example:", repr(shown.completions[0][:300]), flush=True)
    chosen = max(templates, key=lambda n: (results[n]["id"]["pass"], results[n]["id"]["tool_use"]))
    report = {"command": "python scripts/calibrate_templates.py " + " ".join(sys.argv[1:]),
              "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "templates": templates, "results": results, "chosen": chosen}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("chosen:", chosen, flush=True)
    if args.layer:
        with open(args.layer, "w") as f:
            json.dump({"model": {"environment": {"class_path": "scgrpo.envs.CalculatorEnv",
                                                  "init_args": {"template": templates[chosen]}}}}, f)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
