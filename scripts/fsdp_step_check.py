"""One training step's loss and LoRA gradients on fixed rollouts, sharded over the ranks torchrun starts.

    torchrun --nproc_per_node 2 scripts/fsdp_step_check.py --model DIR --out grads2.pt
    python scripts/fsdp_step_check.py --model DIR --out grads1.pt        # one process, no sharding

``main(argv)`` also runs inside a calling process: as one process without a process group where no
``WORLD_SIZE`` is set, or as one rank where the caller has set torchrun's variables (the CPU test runs its
reference so, and forks its ranks).

The global batch (prompts x G completions, rewards) is built from a seed, the same on every rank; rank r
trains on its share of the prompt groups. With more than one rank the policy is sharded with FSDP2 exactly
as ``FSDP2Strategy`` shards it. Rank 0 writes the global loss and the whole (gathered) LoRA gradients, so
runs on different numbers of ranks can be compared (tests/distributed/test_fsdp.py does).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def fixed_rollouts(tokenizer, prompts: int, group: int, completion_len: int, vocab: int, device):
    """A reproducible batch: random completions of varying length, rewards with mixed, all-wrong and
    all-right groups, so that SC-GRPO finds references in some groups and zero advantages in others."""
    from scgrpo.rollout.engine import completion_mask_from_eos
    from scgrpo.rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(1234)
    questions = [f"What is {i} + {i + 1}?" for i in range(prompts)]
    encoded = tokenizer([q for q in questions for _ in range(group)], return_tensors="pt", padding=True)
    n = prompts * group
    completion = torch.randint(3, vocab, (n, completion_len), generator=g)
    ends = torch.randint(completion_len // 2, completion_len, (n,), generator=g)
    completion[torch.arange(n), ends] = tokenizer.eos_token_id
    mask, truncated = completion_mask_from_eos(completion, [tokenizer.eos_token_id])
    completion = torch.where(mask.bool(), completion, torch.full_like(completion, tokenizer.pad_token_id))
    pattern = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1]]
    rewards = torch.tensor([float(pattern[p % 4][j % 4]) for p in range(prompts) for j in range(group)])
    return RolloutBatch(
        prompt_ids=encoded["input_ids"].to(device), prompt_mask=encoded["attention_mask"].to(device),
        completion_ids=completion.to(device), completion_mask=mask.to(device), truncated=truncated.to(device),
        group_size=group, sample_ids=[f"q{p}" for p in range(prompts) for _ in range(group)],
        questions=[q for q in questions for _ in range(group)], answers=[str(2 * p + 1) for p in range(prompts) for _ in range(group)],
        completions=tokenizer.batch_decode(completion, skip_special_tokens=True), rewards=rewards.to(device),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--objective", default="scgrpo", help="grpo, scgrpo, or both: grpo,scgrpo (one process)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in the global batch")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion-len", type=int, default=12)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from scgrpo.models import LoraSettings
    from scgrpo.module import RLVRModule
    from scgrpo.objectives import GRPO, SCGRPO
    from scgrpo.rollout.engine import GenerationSettings
    from scgrpo.verifiers import NumericVerifier

    distributed = "WORLD_SIZE" in os.environ
    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    if distributed:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if world > 1 and args.prompts % world:
        raise SystemExit(f"--prompts ({args.prompts}) must divide evenly over {world} ranks")

    torch.manual_seed(0)  # LoRA initialisation: the same on every rank and in every run
    objectives = {"grpo": GRPO, "scgrpo": SCGRPO}
    names = args.objective.split(",")
    if any(n not in objectives for n in names):
        raise SystemExit(f"--objective: expected grpo and/or scgrpo, got {args.objective}")
    module = RLVRModule(
        model=args.model, objective=objectives[names[0]](), dtype=args.dtype,
        lora=LoraSettings(r=4, alpha=8, extra={"init_lora_weights": False}),
        generation=GenerationSettings(num_generations=args.group, max_new_tokens=args.completion_len),
        verifier=NumericVerifier(), validate_before_training=False, micro_batch_size=args.micro_batch_size,
    )
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        module._device_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("data_parallel",))
    module.configure_model()
    module.to(device)
    module.manual_backward = lambda loss: loss.backward()

    rollouts = fixed_rollouts(module.tokenizer, args.prompts, args.group, args.completion_len,
                              module.policy.config.vocab_size, device)
    share = args.prompts // world * args.group
    local = rollouts.select(torch.arange(rank * share, (rank + 1) * share, device=device))
    from scgrpo.distributed import full_state
    from scgrpo.update import StepSums

    results = {}
    for name in names:  # each objective's step from the same weights (no optimizer step is taken)
        module.objective = objectives[name]()
        for p in module.parameters():
            p.grad = None
        update = module.policy_update()
        plan = update.plan(local, module.run_self_teacher(local))
        sums = StepSums()
        update.accumulate(local, plan, sums)
        grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
        missing = [n for n, g in grads.items() if g is None]
        if missing:
            raise SystemExit(f"no gradient for {len(missing)} LoRA tensors, e.g. {missing[0]}")
        whole = full_state(grads)
        results[name] = {"loss": sums["loss"], "grads": {k: v.float().cpu() for k, v in whole.items()}}
        if rank == 0:
            print(f"world {world}, {name}: loss {sums['loss']:.6f}, {len(whole)} LoRA gradients")
    if rank == 0:
        payload = {"world": world, "results": results}
        if len(names) == 1:  # a single objective's loss and gradients at the top level, as callers expect
            payload.update(results[names[0]])
        torch.save(payload, args.out)
        print(f"-> {args.out}")
    if distributed:
        dist.barrier()
        # leave without tearing down gloo's threads: that teardown can abort the process after the work is done
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
