"""How much the self-teacher's D and weights move when the student's side is the sampler's kept states
(``generation.student_states: rollout``) instead of a forward pass over the rollouts ("forward").

Trains a few SC-GRPO steps (``bench_step.run_case``'s settings) and, at each step, runs the self-teacher twice on the
same rollouts and references: with the student's forward pass, then with the states the sampler kept. Reports, per
step, the divergences' agreement (mean and largest absolute difference, relative to the mean D), the weights f(D) =
D / (D + c) each gives (c: the 0.75 quantile of the step's active D, as SC-GRPO's default), and the two teacher
passes' times. The run itself trains on the kept states' signal.

Usage (on a GPU)::

    python scripts/student_states_probe.py --model <SmolLM2 GGUF or folder> --steps 3 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def compare(forward: torch.Tensor, kept: torch.Tensor, active: torch.Tensor, quantile: float = 0.75) -> dict:
    """Agreement of two ``[N, C]`` divergences over the ``active`` tokens, and of the weights each gives."""
    d_f, d_k = forward[active].double(), kept[active].double()
    c_f = max(float(torch.quantile(d_f, quantile)), 1e-4)
    c_k = max(float(torch.quantile(d_k, quantile)), 1e-4)
    w_f, w_k = d_f / (d_f + c_f), d_k / (d_k + c_k)
    diff = (d_k - d_f).abs()
    return {"tokens": int(active.sum()), "d_mean": float(d_f.mean()), "d_abs_diff_mean": float(diff.mean()),
            "d_abs_diff_max": float(diff.max()), "d_rel_diff": float(diff.mean() / d_f.mean().clamp_min(1e-12)),
            "d_corr": float(torch.corrcoef(torch.stack([d_f, d_k]))[0, 1]), "c_forward": c_f, "c_kept": c_k,
            "w_abs_diff_mean": float((w_k - w_f).abs().mean()), "w_abs_diff_max": float((w_k - w_f).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import bench_step

    from scgrpo.models import resolve_model
    from scgrpo.selfteacher import SelfTeacher

    records = []
    call = SelfTeacher.__call__

    def probed(self, policy, rollouts, *rest, **kwargs):
        states = rollouts.student_states
        if states is None:
            return call(self, policy, rollouts, *rest, **kwargs)
        rollouts.student_states = None
        start = time.perf_counter()
        forward = call(self, policy, rollouts, *rest, **kwargs)
        forward_s = time.perf_counter() - start
        rollouts.student_states = states
        start = time.perf_counter()
        kept = call(self, policy, rollouts, *rest, **kwargs)
        kept_s = time.perf_counter() - start
        active = rollouts.completion_mask.bool() & kept.has_teacher.unsqueeze(1)
        record = compare(forward.divergence, kept.divergence, active)
        record.update(teacher_forward_s=forward_s, teacher_kept_s=kept_s,
                      same_references=forward.references == kept.references)
        print(json.dumps(record), flush=True)
        records.append(record)
        return kept

    SelfTeacher.__call__ = probed
    model = resolve_model(args.model)
    result = bench_step.run_case("student_states_probe", model=model, objective="scgrpo", prompts=args.prompts,
                                 group=args.group, max_new=args.max_new, steps=args.steps, warmup=0,
                                 student_states="rollout")
    payload = {"command": "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
               "card": bench_step.card_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
               "settings": {k: result.get(k) for k in ("prompts_per_gpu", "group_size", "max_new_tokens", "dtype",
                                                       "lora")},
               "error": result.get("error"), "steps": records}
    text = json.dumps(payload, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
