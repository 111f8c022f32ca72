"""TRL's GRPOTrainer at the settings of scripts/bench_step.py's SmolLM2 suite, for a same-card comparison.

    python scripts/bench_trl.py                   # SmolLM2-135M, 32 prompts x G=8, 128 new tokens, LoRA r=16
    python scripts/bench_trl.py --steps 6 --warmup 2

Same model files (the embedded SmolLM2, dequantised once by scgrpo), same prompts (two-digit addition from
scgrpo's arithmetic task, chat template), same G, completion cap, sampling temperature, LoRA (r=16,
alpha=32, all linear layers), bf16 weights, loss "grpo", beta 0, no vLLM, one optimizer step per 32 x 8
completions. Wall time per step is measured from one ``on_step_begin`` to the next (generation included),
peak memory as the maximum of ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the measured
steps. Writes ``benchmarks/results/bench_trl_<card>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import trl
    from bench_step import card_name, card_tag, versions
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scgrpo.data.tasks import ArithmeticTask
    from scgrpo.models import load_tokenizer, resolve_model
    from scgrpo.verifiers import NumericVerifier

    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    rows = ArithmeticTask().rows("train")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": str(r["answer"])}
                                 for r in rows])
    verifier = NumericVerifier()

    def reward(completions, answer, **kwargs):
        return [verifier.verify(c[0]["content"], a).score for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.peaks: list[tuple[float, float]] = []

        def on_step_begin(self, *unused, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.starts.append(time.perf_counter())

        def on_step_end(self, *unused, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.peaks.append((torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30))
            self.end = time.perf_counter()

    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=args.prompts * args.group,  # completions per step
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        loss_type="grpo",
        bf16=cuda,
        use_cpu=not cuda,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_vllm=False,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if cuda else torch.float32)
    timer = Timer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[timer],
    )
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    walls = [b - a for a, b in zip(timer.starts, timer.starts[1:] + [timer.end])][args.warmup:]
    logs = [h for h in trainer.state.log_history if "loss" in h or "reward" in h][args.warmup:]
    result = {
        "case": "trl_grpo", "model": folder, "trl": trl.__version__, "prompts_per_gpu": args.prompts,
        "group_size": args.group, "max_new_tokens": args.max_new, "lora": "r=16 alpha=32 all-linear",
        "dtype": "bfloat16" if cuda else "float32", "warmup_steps": args.warmup, "measured_steps": len(walls),
        "step_walls_s": walls, "wall_s": statistics.median(walls), "total_wall_s": total,
        "completion_length": statistics.median([h["completions/mean_length"] for h in logs
                                                 if "completions/mean_length" in h] or [float("nan")]),
        "reward": statistics.median([h["reward"] for h in logs if "reward" in h] or [float("nan")]),
    }
    if timer.peaks:
        measured = timer.peaks[args.warmup:]
        result["peak_allocated_gib"] = max(p[0] for p in measured)
        result["peak_reserved_gib"] = max(p[1] for p in measured)
    print(json.dumps(result))
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"bench_trl_{card_tag()}.json")
    with open(out, "w") as f:
        json.dump({"suite": "trl", "card": card_name(), "versions": {**versions(), "trl": trl.__version__},
                   "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                   "date": time.strftime("%Y-%m-%d"), "cases": [result]}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
