"""Rollout throughput: the compact engine, the Hugging Face-forward decode loop and ``model.generate`` (dynamic and
static cache), in one process on one card, on randomly initialised models with real shapes.

    python scripts/bench_rollout.py                       # SmolLM2-135M shape at 64 and 512 sequences, the
                                                          # Qwen2.5-1.5B shape at 32 x 512, LoRA merged/unmerged
    python scripts/bench_rollout.py --cases smollm2_64    # one case

Every case: bf16, prompts of 48 random tokens (no padding), ``max_new`` new tokens forced (end-of-sequence
banned until then), sampling at T=1. Each engine runs once untimed (CUDA graphs, ``torch.compile`` and
transformers' static-cache compilation happen there), then ``--repeats`` timed calls bracketed by
``torch.cuda.synchronize``; the median is reported as new tokens per second and ms per new token. LoRA cases
compare the compact engine with r=16 adapters on every linear layer kept unmerged against the same weights
merged (timed in turn, round by round, with each rollout's weight refresh and prefill timed apart too), each with its default decode step (adapters: the Triton block kernels of ``scgrpo.rollout.norms``; none:
the ``torch.compile``'d step), and with engine ``other_step`` each with the other step too; with engine
``lora_after_matmul`` the unmerged model's block kernels with every LoRA term added after its matmul (by the kernels
that read it), at every row count. Also measured: greedy agreement with ``generate`` in bf16 (share of tokens equal, row by row, up to
the first difference) and the sampler's log-probabilities against a full forward pass of the sampled tokens.
Writes ``benchmarks/results/bench_rollout_<card>.json``; ``scripts/bench_table.py`` makes the tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_step import QWEN_1P5B, card_name, card_tag, versions  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
CASES = {
    "smollm2_64": dict(shape="smollm2", family="llama", seqs=64, max_new=128),
    "smollm2_512": dict(shape="smollm2", family="llama", seqs=512, max_new=128),
    "qwen1p5b_32": dict(shape="qwen1p5b", family="qwen2", seqs=32, max_new=512),
    "smollm2_64_lora": dict(shape="smollm2", family="llama", seqs=64, max_new=128, lora=True),
    "smollm2_512_lora": dict(shape="smollm2", family="llama", seqs=512, max_new=128, lora=True),
}
EOS = 2


def build_model(shape: str, family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    dims = SMOLLM2_135M if shape == "smollm2" else QWEN_1P5B
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(**dims, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # trained adapters (B starts at zero): a visible, small update
            torch.nn.init.normal_(param, std=0.02)
    return peft_model.to(torch.bfloat16).eval()


def timed(fn, repeats: int) -> dict:
    return timed_together({"run": fn}, repeats)["run"]


def timed_together(fns: dict, repeats: int) -> dict:
    """Each of ``fns`` run once untimed (graphs, compilation), then ``repeats`` rounds that time each once, in an
    order that rotates from round to round (a drift of the card's clocks or the host's load spreads over every
    engine). A function's ``phases`` attribute, when it has one, collects its own sub-timings (seconds) per call."""
    for fn in fns.values():
        fn()  # warm-up
        getattr(fn, "phases", {}).clear()
    times: dict = {name: [] for name in fns}
    order = list(fns)
    for round_ in range(repeats):
        for name in order[round_ % len(order):] + order[: round_ % len(order)]:  # each round starts elsewhere
            fn = fns[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    stats = {}
    for name, fn in fns.items():
        stats[name] = {"median_s": statistics.median(times[name]), "times_s": times[name]}
        for phase, values in getattr(fn, "phases", {}).items():
            stats[name][f"{phase}_median_s"] = statistics.median(values)
    return stats


def compact_runner(model, ids, mask, max_new: int, greedy: bool = False, **kwargs):
    from scgrpo.rollout.compact import CompactDecoder
    from scgrpo.rollout.slots import SlotDecoder

    decoder = CompactDecoder(model, compile_layers=kwargs.pop("compile_layers", True),
                             block_kernels=kwargs.pop("block_kernels", None),
                             lora_matmul_rows=kwargs.pop("lora_matmul_rows", None))
    sampler = SlotDecoder(decoder, [EOS], EOS, max_new, greedy=greedy, min_new_tokens=0 if greedy else max_new,
                          **kwargs)

    prefill = decoder.prefill

    spent = [0.0]

    def timed_prefill(*args):  # (synchronised: the prompts' forward passes timed apart from the decode steps)
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = prefill(*args)
        torch.cuda.synchronize()
        spent[0] += time.perf_counter() - start
        return logits

    decoder.prefill = timed_prefill

    def run():
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.refresh()  # the adapters' (or merged weights') copies for this rollout
        torch.cuda.synchronize()
        run.phases.setdefault("refresh", []).append(time.perf_counter() - start)
        spent[0] = 0.0
        result = sampler(ids, mask)
        run.phases.setdefault("prefill", []).append(spent[0])  # every prefill of the rollout (chunks of prompts)
        return result

    run.phases = {}
    return run, sampler


def hf_runner(model, ids, mask, max_new: int, static: bool, greedy: bool = False):
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=None if greedy else max_new, pad_token_id=EOS,
                  eos_token_id=EOS, do_sample=not greedy)
    if not greedy:
        kwargs.update(temperature=1.0, top_p=1.0, top_k=None)
    if static:
        kwargs["cache_implementation"] = "static"

    def run():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:]

    return run


def loop_runner(model, ids, mask, max_new: int):
    from scgrpo.rollout.engine import decode_loop

    def run():
        with torch.no_grad():
            return decode_loop(model, ids, mask, max_new, [EOS], EOS, min_new_tokens=max_new, cuda_graphs=True)

    return run


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of tokens equal up to each row's first difference (greedy decodes diverge for good after one)."""
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).long().cumprod(1)
    return float(same.sum()) / same.numel()


def sampler_vs_forward(model, ids, tokens, logprobs) -> dict:
    """|log p_sampler - log p_forward| on the sampled tokens, the forward being the model's own (HF) pass."""
    with torch.no_grad():
        full = torch.cat([ids, tokens], 1)
        logits = model(input_ids=full).logits[:, ids.shape[1] - 1 : -1].float()
        reference = torch.log_softmax(logits, -1).gather(2, tokens.unsqueeze(2)).squeeze(2)
    diff = (logprobs - reference).abs()
    return {"logprob_mismatch_mean": float(diff.mean()), "logprob_mismatch_max": float(diff.max())}


def run_case(name: str, spec: dict, repeats: int, engines: list[str]) -> dict:
    model = build_model(spec["shape"], spec["family"])
    n, max_new = spec["seqs"], spec["max_new"]
    torch.manual_seed(2)
    ids = torch.randint(3, 1000, (n, 48), device="cuda")
    mask = torch.ones_like(ids)
    new_tokens = n * max_new
    result: dict = {"case": name, **spec, "prompt_tokens": 48, "engines": {}}

    def record(engine: str, stats: dict, extra: dict | None = None) -> None:
        stats.update(tok_s=new_tokens / stats["median_s"], ms_per_step=1000 * stats["median_s"] / max_new, **(extra or {}))
        result["engines"][engine] = stats
        print(f"{name:>18} {engine:>16}: {stats['tok_s']:>10,.0f} new tok/s  {stats['ms_per_step']:.2f} ms/step", flush=True)

    if spec.get("lora"):  # each model's default step; with "other_step", the other step too (same call)
        peft_model = add_lora(model)
        merged = copy.deepcopy(peft_model).merge_and_unload()
        runners = {"compact_unmerged": compact_runner(peft_model, ids, mask, max_new)}  # default: block kernels
        if "lora_after_matmul" in engines:  # the block kernels with every LoRA term added after its matmul
            runners["compact_unmerged_lora_after_matmul"] = compact_runner(peft_model, ids, mask, max_new,
                                                                           lora_matmul_rows=0)
        other = "other_step" in engines
        if other:
            runners["compact_unmerged_compiled_step"] = compact_runner(peft_model, ids, mask, max_new,
                                                                       block_kernels=False)
        runners["compact_merged"] = compact_runner(merged, ids, mask, max_new)  # default: the compiled step
        if other:
            runners["compact_merged_block_step"] = compact_runner(merged, ids, mask, max_new, block_kernels=True)
        stats = timed_together({name: run for name, (run, _) in runners.items()}, repeats)
        for engine, (_, sampler) in runners.items():
            record(engine, stats[engine], dict(sampler.stats))
        tokens, logprobs, _ = runners["compact_unmerged"][0]()  # on-policy: against the adapted model's forward
        result["unmerged_sampler_vs_forward_bf16"] = sampler_vs_forward(peft_model, ids, tokens, logprobs)
        e = result["engines"]
        result["unmerged_over_merged"] = e["compact_unmerged"]["median_s"] / e["compact_merged"]["median_s"]
        if "compact_unmerged_lora_after_matmul" in e:
            result["unmerged_lora_after_matmul_over_merged"] = (e["compact_unmerged_lora_after_matmul"]["median_s"]
                                                                / e["compact_merged"]["median_s"])
        if other:  # the same step both ways
            result["unmerged_over_merged_block_step"] = (e["compact_unmerged"]["median_s"]
                                                         / e["compact_merged_block_step"]["median_s"])
            result["unmerged_over_merged_compiled_step"] = (e["compact_unmerged_compiled_step"]["median_s"]
                                                            / e["compact_merged"]["median_s"])
        return result
    if "compact" in engines:
        run, sampler = compact_runner(model, ids, mask, max_new)
        record("compact", timed(run, repeats), dict(sampler.stats))
        tokens, logprobs, _ = run()
        result["sampler_vs_forward_bf16"] = sampler_vs_forward(model, ids, tokens, logprobs)
    if "other_step" in engines:  # the other step: Triton block kernels, not torch.compile'd code
        run, sampler = compact_runner(model, ids, mask, max_new, block_kernels=True)
        record("compact_block_step", timed(run, repeats), dict(sampler.stats))
    if "compact_eager" in engines:
        run, sampler = compact_runner(model, ids, mask, max_new, compile_layers=False)
        record("compact_eager", timed(run, repeats), dict(sampler.stats))
    if "loop_hf_forward" in engines:
        record("loop_hf_forward", timed(loop_runner(model, ids, mask, max_new), repeats))
    if "hf_static" in engines:
        record("hf_static", timed(hf_runner(model, ids, mask, max_new, static=True), repeats))
    if "hf_dynamic" in engines:
        record("hf_dynamic", timed(hf_runner(model, ids, mask, max_new, static=False), max(1, repeats // 2)))
    if "compact" in engines and "hf_static" in engines:
        result["compact_over_hf_static"] = result["engines"]["compact"]["tok_s"] / result["engines"]["hf_static"]["tok_s"]
        greedy_ref = hf_runner(model, ids[:64], mask[:64], 64, static=False, greedy=True)()
        run, _ = compact_runner(model, ids[:64], mask[:64], 64, greedy=True)
        result["greedy_agreement_bf16"] = agreement(run()[0], greedy_ref)
    del model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--engines", default="compact,other_step,compact_eager,loop_hf_forward,hf_static,hf_dynamic")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rollout.py measures GPU throughput; no CUDA device found")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"bench_rollout_{card_tag()}.json")
    report = {"card": card_name(), "versions": versions(),
              "command": " ".join(["python scripts/bench_rollout.py"] + [a for a in sys.argv[1:] if a not in (args.out, "--out")
                                                                     and not a.startswith("--out=")]),
              "cases": {}}
    for name in args.cases.split(","):
        report["cases"][name] = run_case(name, CASES[name], args.repeats, args.engines.split(","))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
