"""Which reasoning_gym settings suit the embedded model: its Pass@k before training and the length of its
correct completions, per (task, settings) candidate.

For each candidate, samples ``--samples`` completions of the first ``--rows`` id rows with the base model (no
LoRA, the run's chat formatting and sampling), scores them with the task's own scorer, and writes one row:
Pass@k, Avg@k, the mean length of all completions and of the correct ones (tokens), truncations. A setting
suits the replication when Pass@k is between 10% and 60% and correct completions take 40 tokens or more.

    python scripts/calibrate_reasoning.py --candidates '[["chain_sum", {"min_terms": 4, "max_terms": 5}]]' \\
        --rows 32 --samples 8 --max-new-tokens 256 --out calibration
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from scgrpo import GenerationSettings, RLVRModule  # noqa: E402
from scgrpo.data import ReasoningGymTask  # noqa: E402
from scgrpo.data.reasoning import DEFAULT_INSTRUCTION, EXTRACTIONS  # noqa: E402


def calibrate(policy, task: str, config: dict, rows: int, samples: int, batch_rows: int = 16,
              extraction: str = "tag", instruction: str = DEFAULT_INSTRUCTION) -> dict:
    """Pass@k, Avg@k and completion lengths of the base model on one candidate's first ``rows`` id rows."""
    source = ReasoningGymTask(task, config, num_train=1, num_eval=rows, extraction=extraction, instruction=instruction)
    verifier, start = source.default_verifier(), time.perf_counter()
    scores, lengths, truncated, example = [], [], [], None
    items = source.rows("id")
    for b in range(0, len(items), batch_rows):
        chunk = items[b : b + batch_rows]
        out = policy.sample(policy.format_prompts([r["question"] for r in chunk]), samples)
        for i, completion in enumerate(out.completions):
            scores.append(verifier.verify(completion, chunk[i // samples]["answer"]).score)
            if example is None and scores[-1] >= 1.0:
                example = {"question": chunk[i // samples]["question"], "completion": completion}
        lengths += out.completion_mask.sum(1).tolist()
        truncated += out.truncated.float().tolist()
    per_row = [scores[i : i + samples] for i in range(0, len(scores), samples)]
    correct = [n for s, n in zip(scores, lengths) if s >= 1.0]
    return {
        "task": task, "config": config, "extraction": extraction, "rows": len(per_row), "samples": samples,
        "pass_at_k": sum(max(r) >= 1.0 for r in per_row) / len(per_row),
        "avg_at_k": sum(x >= 1.0 for x in scores) / len(scores),  # as evaluation counts: right when the score is 1
        "mean_length": sum(lengths) / len(lengths),
        "mean_correct_length": sum(correct) / len(correct) if correct else None,
        "correct": len(correct), "truncated": sum(truncated) / len(truncated),
        "seconds": round(time.perf_counter() - start, 1), "example_correct": example,
    }


def suits(row: dict) -> bool:
    return 0.10 <= row["pass_at_k"] <= 0.60 and (row["mean_correct_length"] or 0) >= 40


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", required=True, help='JSON list of [task, settings] pairs')
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--extraction", default="tag", choices=EXTRACTIONS)
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="calibration", help="writes <out>.json and <out>.md")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    module = RLVRModule(model=args.model, dtype=args.dtype, lora=None,
                        generation=GenerationSettings(num_generations=args.samples, max_new_tokens=args.max_new_tokens))
    module.configure_model()
    module.to(torch.device(args.device))
    results = [calibrate(module.actor, task, config, args.rows, args.samples, extraction=args.extraction,
                         instruction=args.instruction) for task, config in json.loads(args.candidates)]
    k = args.samples
    lines = [f"| task | settings | Pass@{k} | Avg@{k} | mean length | mean correct length | truncated | suits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        correct = "-" if r["mean_correct_length"] is None else f"{r['mean_correct_length']:.0f}"
        lines.append(f"| {r['task']} | `{json.dumps(r['config'])}` | {r['pass_at_k']:.2f} | {r['avg_at_k']:.3f} | "
                     f"{r['mean_length']:.0f} | {correct} | {r['truncated']:.2f} | {'yes' if suits(r) else 'no'} |")
    command = shlex.join(["python", "scripts/calibrate_reasoning.py", *(sys.argv[1:] if argv is None else argv)])
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    with open(f"{args.out}.json", "w") as f:
        json.dump({"command": command, "device": device, "model": args.model, "dtype": args.dtype,
                   "max_new_tokens": args.max_new_tokens, "extraction": args.extraction,
                   "instruction": args.instruction, "results": results}, f, indent=1)
    with open(f"{args.out}.md", "w") as f:
        f.write("\n".join(lines + ["", f"{args.model}, {args.dtype}, {device}, answers read by `{args.extraction}`. "
                                    f"Command: `{command}`", ""]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
