"""Per-phase timing and peak GPU memory of full RL steps (Lightning Trainer, real callbacks), per case.

    python scripts/bench_step.py --suite smollm2        # SmolLM2-135M real weights at TRL's figure's settings
    python scripts/bench_step.py --suite qwen1p5b       # random Qwen2.5-1.5B-shaped model, bf16 LoRA and QLoRA
    python scripts/bench_step.py --suite fsdp --devices 1   # then --devices 2: FSDP throughput at equal per-GPU batch
    python scripts/bench_step.py --suite qwen8b         # random Qwen3-8B-shaped model, nf4 QLoRA: 4-bit sampling
                                                        # speeds, 1,024-token steps, a 4,096-token step in 20 GiB

With ``--before-src DIR`` (an earlier commit's tree: ``git archive <commit> src | tar -x -C DIR``) the
``qwen8b`` suite first times the same rollouts with that source tree, in a subprocess of the same call
(``qwen8b_sampling_before``): the same-call baseline of the 4-bit sampling speed-up.

The ``qwen8b`` suite's ``*_sampling_*`` cases time rollouts alone (64 rows, ``--sampling-tokens`` new tokens
forced, the median of ``--repeats`` calls after one untimed call) for each way the compact decoder multiplies
by the 4-bit base (``GenerationSettings.four_bit``), and measure the sampler's log-probabilities against the
trainer's forward pass on 8 of the rows. Its step cases run with ``--warmup``/``--steps`` unless the case
fixes them; a case with ``memory_fraction_gib`` limits the process with
``torch.cuda.set_per_process_memory_fraction`` (the allocator fails rather than reserve more).

Each case trains ``--warmup`` steps (not counted: CUDA graphs, allocator, first kernels) then ``--steps``
measured steps, and reports medians over the measured ones: wall time per step (from one step's start to
the next one's), the phases the module times itself (generation, verification, teacher pass, train
forward+backward+optimizer; each bracketed by ``torch.cuda.synchronize``), tokens per second for each, and
the peak of ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the measured steps.
Writes ``benchmarks/results/bench_<suite>_<card>.json`` (``--out`` to change); ``scripts/bench_table.py``
turns the results into ``docs/benchmarks.md`` and ``benchmarks/results/summary.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from scgrpo.verifiers import VerificationResult, Verifier  # noqa: E402

QWEN_1P5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)


def card_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"


def card_tag() -> str:
    name = card_name()
    for tag in ("H200", "H100", "A100", "L4", "4090", "3090"):
        if tag in name:
            return tag.lower()
    return "cpu" if not torch.cuda.is_available() else "gpu"


def versions() -> dict[str, str]:
    import lightning
    import peft
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
           "lightning": lightning.__version__, "python": platform.python_version()}
    try:
        import bitsandbytes

        out["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        pass
    return out


# Qwen3-8B's shapes (36 layers, 4096 wide, 32 query and 8 key/value heads of 128, MLP 12288, untied head); built as
# a Qwen2 model (q/k/v biases, no q/k norms) like the measurements this suite's targets were set against, or with
# --blocks qwen3 as a Qwen3 model
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


def random_qwen_folder(tokenizer_source: str, shape: str = "qwen2.5-1.5b", blocks: str = "qwen2") -> str:
    """A randomly initialised model with Qwen2.5-1.5B's (or ``shape="qwen3-8b"``: Qwen3-8B's) shapes, saved in
    bf16 with SmolLM2's tokenizer (its ids fit the bigger vocabulary), so that the 4-bit path loads it like any
    checkpoint. ``blocks``: "qwen2" (q/k/v biases, no q/k norms) or "qwen3" (Qwen3's blocks: per-head q/k
    norms, no biases)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    folder = os.path.join(tempfile.gettempdir(), "scgrpo-bench",
                          f"{shape}-shaped" + ("" if blocks == "qwen2" else f"-{blocks}-blocks"))
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    dims = QWEN3_8B if shape == "qwen3-8b" else QWEN_1P5B
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if blocks == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(**dims, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # (an 8B model in fp32 first would take 32 GB)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = model_class(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


class CoinFlipVerifier(Verifier):
    """Reward 1 or 0 from a hash of the completion's text: random-weight models never solve a task, and with
    all rewards equal every row would have zero advantage and the training and teacher phases would not run.
    About half of each group is rewarded, so (almost) every group is mixed and every row is trained."""

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        digest = hashlib.sha256(completion.encode()).digest()
        return VerificationResult(score=float(digest[0] % 2))


class StepRecorder(Callback):
    """Per step: the module's own phase timings and token counts, wall time and peak GPU memory."""

    def __init__(self, snapshot: Optional[str] = None, snapshot_step: int = -1, profile: Optional[str] = None) -> None:
        self.steps: list[dict[str, float]] = []
        self._start: Optional[float] = None
        # torch.profiler over the snapshot step (the last measured one), its kernel table written to ``profile``:
        # with a watched module, from the end of its sampling (the rollouts have their own cases and profiles; a
        # whole 8B step's trace takes minutes to reduce) to the step's end: the teacher pass and the update
        self.profile, self._profiler, self._armed, self._watching = profile, None, False, False
        # the allocator's trace of every step up to this one, to a file (scripts/memory_peaks.py reads it)
        self.snapshot, self.snapshot_step = snapshot, snapshot_step
        self._calls = 0

    def watch(self, module, case: str) -> None:
        """Prints a line as each phase of a step ends (elapsed time, peak reserved so far): a long step cut by a
        time limit still tells how far it got."""
        step, teacher = module.training_step, module.run_self_teacher

        def stepped(*args, **kwargs):  # (the rollout stage has run: the batch holds its rollouts)
            self.progress(case, "sampling")
            if self._armed:  # the profiled step: from here to its end
                self._start_profiler()
            return step(*args, **kwargs)

        def taught(*args, **kwargs):
            out = teacher(*args, **kwargs)
            if out is not None:  # (an objective without a self-teacher has no teacher pass)
                self.progress(case, "teacher pass")
            return out

        module.training_step, module.run_self_teacher = stepped, taught
        self._case, self._watching = case, True

    def _start_profiler(self) -> None:
        self._armed = False
        self._profiler = new_profiler()
        self._profiler.__enter__()

    def progress(self, case: str, phase: str) -> None:
        if self._start is None:
            return
        reserved = ""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            reserved = f", peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB"
        print(f"[{case}] step {self._calls}: {phase} done at {time.perf_counter() - self._start:.1f} s{reserved}",
              flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.snapshot and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=4_000_000)
            self._before = torch.cuda.memory_allocated()

    @staticmethod
    def step_start_mark() -> None:
        """An allocation the trace's reader finds by this function's name: where a step starts."""
        torch.empty(1, device="cuda")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._start is not None and self.steps and "wall_s" not in self.steps[-1]:
            # one step's start to the next one's, less the writing of the last step's profile
            self.steps[-1]["wall_s"] = self.steps[-1]["end_s"] if self.steps[-1].get("profiled") else now - self._start
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if self.snapshot:
                self.step_start_mark()
        self._calls += 1
        if self.profile and self._calls - 1 == self.snapshot_step:
            self._armed = True  # started once the step's rollouts are sampled (see watch); else here
            if not self._watching:
                self._start_profiler()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {k: float(v) for k, v in pl_module.last_step_metrics.items()}
        if torch.cuda.is_available():  # the module resets the peak between phases: the step's is their maximum
            torch.cuda.synchronize()
            phases = [v for k, v in record.items() if k.startswith("memory/") and k.endswith("_peak_gib")]
            record["peak_allocated_gib"] = max([torch.cuda.max_memory_allocated() / 2**30, *phases])
            record["peak_reserved_gib"] = max(torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved()) / 2**30
            if self.snapshot and self._calls - 1 == self.snapshot_step:  # for scripts/memory_peaks.py
                import pickle

                trace = torch.cuda.memory._snapshot()
                trace.update(scgrpo_allocated_before=self._before, scgrpo_device=torch.cuda.current_device())
                torch.cuda.memory._record_memory_history(enabled=None)
                with open(self.snapshot, "wb") as f:
                    pickle.dump(trace, f)
        record["end_s"] = time.perf_counter() - self._start  # (before the profile is reduced and written)
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            write_profile(self._profiler, self.profile)
            self._profiler = None
            record["profiled"] = 1.0  # its phase times include the profiler's overhead
        self.steps.append(record)
        if getattr(self, "_case", None):
            self.progress(self._case, "step")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.steps and "wall_s" not in self.steps[-1]:
            self.steps[-1]["wall_s"] = self.steps[-1]["end_s"]  # the last step has no successor


def new_profiler():
    """A torch.profiler over the CPU and, where there is one, the GPU (enter it to start)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []))


def write_profile(profiler, path: str) -> None:
    """A profile as text: the phases (``scgrpo.*`` ranges met: teacher pass, update) and the 40
    operations with the most GPU time (self time, so that nested calls are not counted twice)."""
    events = profiler.key_averages()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = "device_time_total" if hasattr(events[0], "device_time_total") else f"{device}_time_total"
    phases = sorted((e for e in events if e.key.startswith("scgrpo.")), key=lambda e: e.key)
    lines = ["phase  wall (CPU-side) ms  GPU ms"]
    lines += [f"{e.key}  {e.cpu_time_total / 1e3:.1f}  {getattr(e, total, 0) / 1e3:.1f}" for e in phases]
    sort = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else f"self_{device}_time_total"
    lines += ["", events.table(sort_by=sort, row_limit=40, max_name_column_width=80)]
    lines += ["", "host (CPU) time:", events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80)]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
    def med(key: str) -> Optional[float]:
        values = [s[key] for s in steps if key in s and s[key] == s[key]]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {"measured_steps": len(steps)}
    for key in ("memory/rollout_peak_gib", "memory/scoring_peak_gib", "memory/teacher_peak_gib", "memory/update_peak_gib",
                "memory/budget_gib", "memory/update_passes", "memory/update_tokens_per_pass", "memory/teacher_passes",
                "memory/student_passes", "memory/gradient_checkpointing", "memory/train_kib_per_token",
                "memory/forward_kib_per_token", "memory/train_checkpointed_kib_per_token",
                "wall_s", "time/step_s", "time/generation_s", "time/verification_s", "time/scoring_s",
                "time/teacher_s", "time/train_s", "tokens/completion", "tokens/train", "tokens/teacher",
                "train/completion_length", "train/reward", "rollout/slots", "rollout/decode_steps",
                "rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max"):
        value = med(key)
        if value is not None:
            out[key.replace("/", "_")] = value
    pairs = {"generation_tok_s": ("tokens/completion", "time/generation_s"),
             "teacher_tok_s": ("tokens/teacher", "time/teacher_s"),
             "train_tok_s": ("tokens/train", "time/train_s")}
    for name, (tokens, seconds) in pairs.items():
        rates = [s[tokens] / s[seconds] for s in steps if s.get(seconds, 0) > 0 and tokens in s]
        if rates:
            out[name] = statistics.median(rates)
    for key in ("peak_allocated_gib", "peak_reserved_gib"):
        values = [s[key] for s in steps if key in s]
        if values:
            out[key] = max(values)
    return out


def run_case(name: str, *, model: str, objective: str, prompts: int, group: int, max_new: int, min_new: int = 0,
             quantization: Optional[str] = None, gradient_checkpointing: Optional[bool] = None,
             micro_batch_size: Optional[int] = None, steps: int = 5, warmup: int = 2, devices: int = 1,
             cuda_graphs: bool = True, lr: float = 1e-5, coin_flip_rewards: bool = False,
             decode_forward: str = "auto", max_slots: int = 0, keep_workspace: bool = True,
             logprob_chunk_size: int = 1024, memory_snapshot: Optional[str] = None, four_bit: str = "auto",
             memory_budget_gib: Optional[float] = None, memory_fraction_gib: Optional[float] = None,
             profile: Optional[str] = None, fused_lora: bool = True, fused_16bit: bool = True,
             cudnn_attention: bool = False, shared_teacher_passes: bool = True,
             stream_kernel: Optional[str] = None, packed: bool = True, packed_update: bool = True,
             pack_width: Optional[int] = None, shared_prefixes: bool = True,
             student_states: str = "auto", model_budget_gib: Optional[float] = None) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning.pytorch import Callback

    from scgrpo import packing as packing_module
    from scgrpo.policy import PassOptions
    from scgrpo.rollout import four_bit as four_bit_module

    from scgrpo.data import PromptDataModule
    from scgrpo.distributed import FSDP2Strategy
    from scgrpo.models import LoraSettings
    from scgrpo.module import RLVRModule
    from scgrpo.objectives import GRPO, SCGRPO
    from scgrpo.rollout.engine import GenerationSettings

    pl.seed_everything(0, verbose=False)
    module = RLVRModule(
        model=model,
        objective=SCGRPO() if objective == "scgrpo" else GRPO(),
        lora=LoraSettings(r=16, alpha=32, fused_4bit=fused_lora, fused_16bit=fused_16bit),
        dtype="bfloat16",
        quantization=quantization,
        generation=GenerationSettings(num_generations=group, max_new_tokens=max_new, min_new_tokens=min_new,
                                      cuda_graphs=cuda_graphs, decode_forward=decode_forward, max_slots=max_slots,
                                      keep_workspace=keep_workspace, four_bit=four_bit,
                                      memory_budget_gib=memory_budget_gib, student_states=student_states),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
        gradient_checkpointing=gradient_checkpointing,
        micro_batch_size=micro_batch_size,
        logprob_chunk_size=logprob_chunk_size,
        memory_budget_gib=model_budget_gib,  # (model.memory_budget_gib: every pass of the step, the rollout's too)
        validate_before_training=False,
        log_completions_every_n_steps=0,
        verifier=CoinFlipVerifier() if coin_flip_rewards else None,
    )
    data = PromptDataModule(source="arithmetic", batch_size=prompts, eval_splits=[])
    recorder = StepRecorder(memory_snapshot, warmup + steps - 1, profile)

    class Passes(Callback):  # the case's pass options, on the policy once it is loaded
        def on_fit_start(self, trainer, pl_module) -> None:
            pl_module.actor.passes = PassOptions(packing=packed, packed_training=packed_update,
                                                 cudnn_attention=cudnn_attention,
                                                 shared_teacher_passes=shared_teacher_passes)

    passes = Passes()
    recorder.watch(module, name)
    root = tempfile.mkdtemp(prefix="scgrpo-bench-")
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=devices,
        strategy=FSDP2Strategy() if devices > 1 else "auto",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=[recorder, passes],
    )
    limited = memory_fraction_gib is not None and torch.cuda.is_available()
    if limited:  # the allocator may not reserve more than this: a step that needs more fails here
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(memory_fraction_gib * 2**30 / torch.cuda.mem_get_info()[1])
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    defaults = (four_bit_module.STREAM_KERNEL, packing_module.PACK_WIDTH, packing_module.SHARED_PREFIXES)
    packing_module.SHARED_PREFIXES = shared_prefixes
    four_bit_module.STREAM_KERNEL = stream_kernel or defaults[0]
    packing_module.PACK_WIDTH = pack_width or packing_module.PACK_WIDTH
    error = None
    try:
        trainer.fit(module, data)
    except Exception as err:  # noqa: BLE001 - a failed case keeps the steps it finished; the next case runs
        error = f"{type(err).__name__}: {' '.join(str(err).split())}"
        print(f"[{name}] failed after {len(recorder.steps)} step(s): {error}", flush=True)
    finally:
        four_bit_module.STREAM_KERNEL, packing_module.PACK_WIDTH, packing_module.SHARED_PREFIXES = defaults
        if limited:
            process_peak = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.set_per_process_memory_fraction(1.0)
    result = {
        "case": name, "model": model, "objective": objective, "quantization": quantization,
        "prompts_per_gpu": prompts, "group_size": group, "max_new_tokens": max_new, "min_new_tokens": min_new,
        "lora": "r=16 alpha=32 all-linear", "dtype": "bfloat16", "gradient_checkpointing": gradient_checkpointing,
        "micro_batch_size": micro_batch_size, "devices": devices, "warmup_steps": warmup,
        "decode_forward": decode_forward, "max_slots": max_slots, "keep_workspace": keep_workspace,
        "logprob_chunk_size": logprob_chunk_size, "four_bit": four_bit, "memory_budget_gib": memory_budget_gib,
        "model_budget_gib": model_budget_gib,
        "memory_fraction_gib": memory_fraction_gib, "fused_lora": fused_lora, "fused_16bit": fused_16bit,
        "cudnn_attention": cudnn_attention, "shared_teacher_passes": shared_teacher_passes,
        "stream_kernel": stream_kernel or defaults[0], "packed": packed, "packed_update": packed_update,
        "pack_width": pack_width or defaults[1], "shared_prefixes": shared_prefixes, "student_states": student_states,
        "rewards": "coin flip (hash of the text)" if coin_flip_rewards else "arithmetic verifier",
        "total_wall_s": time.perf_counter() - start,
        # (a failed case: every step it finished, warm-up included, and the error)
        "steps": recorder.steps[warmup:] if error is None else recorder.steps,
    }
    result.update(summarise(result["steps"]))
    if error is not None:
        result["error"] = error
    if limited:  # the whole run's (model loading included), not only the measured steps'
        result["process_peak_reserved_gib"] = process_peak
    if result.get("wall_s"):
        result["completions_per_s_per_gpu"] = prompts * group / result["wall_s"]
    if module.actor is not None:  # (a case that failed before its policy loaded holds none)
        module.actor.release_rollout_workspaces()  # the next case's peak must not include this one's KV caches or graphs
    del module, trainer, data
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return result


def run_sampling_cases(cases: dict[str, dict[str, Any]], *, model: str, rows: int, group: int, new_tokens: int,
                       repeats: int, profile: Optional[str] = None) -> list[dict[str, Any]]:
    """Rollouts alone on one loaded QLoRA policy (nf4 base, LoRA r=16 with non-zero B's), one case per
    ``four_bit`` setting (and ``chunk``: :data:`scgrpo.rollout.four_bit.STREAM_CHUNK`): ``rows`` rows (``rows /
    group`` arithmetic prompts x ``group``), ``new_tokens`` forced. Median seconds per call over ``repeats``
    calls after an untimed one, ms per decode step, and the sampler's log-probabilities of 8 rows against the
    trainer's forward pass (bf16, the 4-bit layers' own matmuls). With ``profile``, one more call runs under
    torch.profiler and its kernel table goes to ``profile.<case>.txt``."""
    from sampling_probe import qlora_policy_and_prompts

    from scgrpo.rollout import four_bit as four_bit_module
    from scgrpo.rollout.backends import CompactSampler
    from scgrpo.rollout.engine import GenerationSettings, generate

    device = torch.device("cuda", torch.cuda.current_device())
    policy, tokenizer, prompts = qlora_policy_and_prompts(model, rows, group, device)
    results = []
    default_chunk, default_kernel = four_bit_module.STREAM_CHUNK, four_bit_module.STREAM_KERNEL
    for name, spec in cases.items():
        print(f"== {name}", flush=True)
        four_bit_module.STREAM_CHUNK = spec.get("chunk", default_chunk)
        four_bit_module.STREAM_KERNEL = spec.get("kernel", default_kernel)
        settings = GenerationSettings(num_generations=group, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      four_bit=spec["four_bit"], keep_workspace=True)
        torch.manual_seed(0)
        backend = CompactSampler()  # (this case's workspaces)
        first = time.perf_counter()
        generate(policy, tokenizer, prompts, group, settings, device, sampler=backend)  # records graphs, compiles
        torch.cuda.synchronize()
        first = time.perf_counter() - first
        times = []
        torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(policy, tokenizer, prompts, group, settings, device, sampler=backend)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        gap = sampler_vs_trainer(policy, out, rows=8)
        seconds = statistics.median(times)
        if profile:
            with new_profiler() as prof:
                generate(policy, tokenizer, prompts, group, settings, device, sampler=backend)
                torch.cuda.synchronize()
            write_profile(prof, f"{profile}.{name}.txt")
        result = {"case": name, "model": model, "quantization": "nf4", "lora": "r=16 alpha=32 all-linear",
                  "four_bit": spec["four_bit"], "stream_chunk": four_bit_module.STREAM_CHUNK,
                  "stream_kernel": four_bit_module.STREAM_KERNEL, "rows": rows,
                  "new_tokens": new_tokens, "first_call_s": first, "seconds": times, "median_s": seconds,
                  "ms_per_decode_step": 1000 * seconds / new_tokens, "new_tok_s": rows * new_tokens / seconds,
                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                  "decode_modes": sorted({p.mode for e in _decoders(backend, policy) for p in e}),
                  "stats": {k: float(v) for k, v in out.stats.items()}, **gap}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()
                          if k not in ("seconds", "stats")}), flush=True)
        results.append(result)
        backend.release()
        torch.cuda.empty_cache()
    four_bit_module.STREAM_CHUNK, four_bit_module.STREAM_KERNEL = default_chunk, default_kernel
    del policy
    torch.cuda.empty_cache()
    return results


def run_before(source: str, model: str, *, rows: int, group: int, new_tokens: int, repeats: int,
               case: str = "qwen8b_sampling_before") -> dict[str, Any]:
    """``qwen8b_sampling_before``: rollouts alone as :func:`run_sampling_cases` times them, by the package's source
    tree ``source`` (an earlier commit), in a subprocess (scripts/sampling_probe.py)."""
    import subprocess

    print(f"== {case}", flush=True)
    tree = next((os.path.realpath(d) for d in (source, os.path.join(source, "src"))
                 if os.path.isfile(os.path.join(d, "scgrpo", "__init__.py"))), None)
    if tree is None:
        raise SystemExit(f"--before-src {source}: no scgrpo/__init__.py in it or in its src/")
    here = os.path.realpath(os.path.join(ROOT, "src"))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != here]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, *paths]))
    probe = os.path.join(ROOT, "scripts", "sampling_probe.py")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "before.json")
        done = subprocess.run([sys.executable, probe, model, str(rows), str(group), str(new_tokens), str(repeats), path],
                              env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"the probe of {tree} failed:\n{done.stderr[-3000:]}")
        with open(path) as f:
            result = json.load(f)
    if not os.path.realpath(result["source"]).startswith(tree + os.sep):
        raise RuntimeError(f"the probe imported {result['source']}, not the tree in {tree}")
    result.update(case=case, model=model, quantization="nf4", lora="r=16 alpha=32 all-linear",
                  four_bit="before", stream_chunk=0, before_src=source,
                  logprob_mismatch_mean=None, logprob_mismatch_max=None)
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}), flush=True)
    return result


def _decoders(backend, policy) -> list[list]:
    entry = backend.decoders.get(policy) or {}
    decoder = entry.get("decoder")
    return [decoder._projections] if decoder is not None else []


@torch.no_grad()
def sampler_vs_trainer(policy, generated, rows: int) -> dict[str, float]:
    """|log pi_sampler - log pi_trainer| over the sampled tokens of the first ``rows`` rows (the trainer: a forward
    pass of prompt + completion through the policy, bf16 logits -> fp32 log-softmax)."""
    ids = torch.cat([generated.prompt_ids[:rows], generated.completion_ids[:rows]], 1)
    mask = torch.cat([generated.prompt_mask[:rows], generated.completion_mask[:rows].long()], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    c = generated.completion_ids.shape[1]
    gaps = []
    for i in range(rows):  # one row at a time: [T, V] fp32 logits of a 152k vocabulary
        logits = policy(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1],
                        position_ids=positions[i : i + 1]).logits[0, -c - 1 : -1].float()
        trainer = torch.log_softmax(logits, -1).gather(1, generated.completion_ids[i].unsqueeze(1)).squeeze(1)
        keep = generated.completion_mask[i].bool()
        gaps.append((trainer - generated.sampler_logprobs[i])[keep].abs())
    gap = torch.cat(gaps)
    return {"logprob_mismatch_mean": float(gap.mean()), "logprob_mismatch_max": float(gap.max())}


def trl_result(path: str) -> dict[str, Any]:
    """TRL's case from ``scripts/bench_trl.py``'s result file, with that file's command, card and date (the step and
    its peak memory, ``peak_allocated_gib``, measured on this card in this call)."""
    payload = json.load(open(path))
    (case,) = [c for c in payload["cases"] if c.get("case") == "trl_grpo"]
    if not case.get("peak_allocated_gib"):
        raise SystemExit(f"{path}: TRL's case has no peak memory (it ran without a GPU?)")
    return {**case, "trl_command": payload["command"], "trl_card": payload["card"], "trl_date": payload.get("date")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", required=True, choices=["smollm2", "qwen1p5b", "fsdp", "qwen8b"])
    parser.add_argument("--sampling-tokens", type=int, default=128,
                        help="qwen8b: new tokens of each timed rollout of the *_sampling_* cases")
    parser.add_argument("--repeats", type=int, default=3, help="qwen8b: timed rollouts per sampling case")
    parser.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "qwen2.5-1.5b"],
                        help="qwen8b: the random model's shapes (qwen2.5-1.5b: a quick check of the suite)")
    parser.add_argument("--blocks", default="qwen2", choices=["qwen2", "qwen3"],
                        help="qwen8b: the random model's blocks: qwen2 (q/k/v biases) or qwen3 (Qwen3's per-head q/k "
                             "norms, as the consumer config's Qwen3-8B); qwen3 names every case *_qwen3_blocks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default="smollm2", help="the real model (default: the embedded SmolLM2)")
    parser.add_argument("--tokenizer", default=None,
                        help="qwen1p5b, qwen8b: a tokenizer folder for the random model (default: --model's)")
    parser.add_argument("--max-new", type=int, default=None, help="override the suite's completion length")
    parser.add_argument("--profile", default=None,
                        help="write a torch.profiler table of each case's last step after its sampling (a sampling "
                             "case: one more rollout) to PATH (case name appended); that step's times include the "
                             "profiler's overhead (time with a run without it): "
                             "GPU time of the phases and of the 40 heaviest operations")
    parser.add_argument("--before-src", default=None,
                        help="qwen8b, with sampling cases: also time rollouts alone with the package's source in DIR "
                             "or DIR/src (an earlier commit's, e.g. `git archive <commit> src | tar -x -C DIR`; name DIR "
                             "after the commit: the results record DIR), in a "
                             "subprocess of this call, as the case "
                             "qwen8b_sampling_before (scripts/sampling_probe.py)")
    parser.add_argument("--trl-result", default=None,
                        help="smollm2: scripts/bench_trl.py's result file of this call: adds the cases "
                             "smollm2_{grpo,scgrpo}_at_trl_memory (model.memory_budget_gib set to TRL's measured peak "
                             "allocated) and copies TRL's case into this file's results, so that one file holds both "
                             "sides of step_over_trl_at_trl_memory")
    parser.add_argument("--memory-snapshot", default=None,
                        help="write the allocator's trace of each case's last step to PATH (case name appended), "
                             "for scripts/memory_peaks.py")
    parser.add_argument("--nf4-launch", default=None,
                        help="the fused nf4 matmul's settings by shape: a scripts/tune_nf4_matmul.py result's "
                             "launches (scgrpo.rollout.nf4_matmul.TUNED)")
    args = parser.parse_args()
    if args.nf4_launch:
        from scgrpo.rollout import nf4_matmul

        with open(args.nf4_launch) as f:
            nf4_matmul.TUNED = json.load(f)["launches"]

    from scgrpo.models import resolve_model

    # (random-weight suites read only the tokenizer: --tokenizer names a folder that holds one instead)
    smollm2 = args.tokenizer or resolve_model(args.model)
    suffix = "" if args.blocks == "qwen2" else f"_{args.blocks}_blocks"  # (qwen8b: case names by kind of block)
    cases: dict[str, dict[str, Any]] = {}
    sampling: dict[str, dict[str, Any]] = {}
    if args.suite == "smollm2":  # the TRL figure's settings: 32 prompts x G=8, 128 new tokens, LoRA r=16, bf16
        common = dict(model=smollm2, prompts=32, group=8, max_new=128)
        cases["smollm2_grpo"] = dict(objective="grpo", **common)
        cases["smollm2_scgrpo"] = dict(objective="scgrpo", **common)
        if args.trl_result:  # the package's steps held to the memory TRL used in this call (its peak allocated)
            trl_case = trl_result(args.trl_result)
            for objective in ("grpo", "scgrpo"):
                cases[f"smollm2_{objective}_at_trl_memory"] = dict(
                    objective=objective, model_budget_gib=trl_case["peak_allocated_gib"], **common)
        # the package defaults with the process held to 22 GiB (a 24 GB card): the memory budget's default reads the cap
        cases["smollm2_grpo_22gib"] = dict(objective="grpo", memory_fraction_gib=22.0, **common)
        cases["smollm2_scgrpo_22gib"] = dict(objective="scgrpo", memory_fraction_gib=22.0, **common)
        # ... with gradient checkpointing on (the budget's choice is then one checkpointed pass, not two plain ones)
        cases["smollm2_scgrpo_22gib_checkpointing"] = dict(objective="scgrpo", memory_fraction_gib=22.0,
                                                           gradient_checkpointing=True, **common)
        # the same step before the adapter terms of the bf16 layers were fused (peft's fp32 branch)
        cases["smollm2_scgrpo_peft_lora"] = dict(objective="scgrpo", fused_16bit=False, **common)
        # the step's passes free to use cuDNN's attention (PassOptions.cudnn_attention), and the self-teacher's
        # student and teacher rows in passes of their own (PassOptions.shared_teacher_passes off)
        for objective in ("grpo", "scgrpo"):
            cases[f"smollm2_{objective}_cudnn_attention"] = dict(objective=objective, cudnn_attention=True, **common)
        cases["smollm2_scgrpo_separate_teacher_passes"] = dict(objective="scgrpo", shared_teacher_passes=False, **common)
        # the student's side by a forward pass (generation.student_states "forward", what "auto" takes at this length),
        # or from the sampler's kept states ("rollout"; bench_smollm2_rollout_states_h200.json's smollm2_scgrpo case
        # ran so, with "auto" before it took the forward here)
        cases["smollm2_scgrpo_forward_states"] = dict(objective="scgrpo", student_states="forward", **common)
        cases["smollm2_scgrpo_rollout_states"] = dict(objective="scgrpo", student_states="rollout", **common)
        # every pass padded to its longest row (before scgrpo.packing); the update's passes padded; rows of 256 columns
        for objective in ("grpo", "scgrpo"):
            cases[f"smollm2_{objective}_padded"] = dict(objective=objective, packed=False, **common)
            cases[f"smollm2_{objective}_padded_update"] = dict(objective=objective, packed_update=False, **common)
            cases[f"smollm2_{objective}_pack256"] = dict(objective=objective, pack_width=256, **common)
        for objective in ("grpo", "scgrpo"):  # packed, but a group's rows each with their own copy of the prompt
            cases[f"smollm2_{objective}_unshared_prompts"] = dict(objective=objective, shared_prefixes=False, **common)
        cases["smollm2_grpo_no_graphs"] = dict(objective="grpo", cuda_graphs=False, **common)
        # the decode loop over the Hugging Face forward (the engine before the compact forward), same call
        cases["smollm2_grpo_hf_forward"] = dict(objective="grpo", decode_forward="hf", **common)
        # as TRL runs by default: gradient checkpointing; rows in micro-batches of 64
        low = dict(common, gradient_checkpointing=True, micro_batch_size=64)
        cases["smollm2_grpo_checkpointing_hf_forward"] = dict(objective="grpo", decode_forward="hf", **low)
        # memory-lean: 32 decode slots (waiting rows refill them as others end): a KV cache for 32 rows, freed
        # with the weight copies after each rollout; micro-batches of 32 rows; fp32 logits in blocks of 128 tokens
        low = dict(low, max_slots=32, keep_workspace=False, micro_batch_size=32, logprob_chunk_size=128)
        cases["smollm2_grpo_checkpointing"] = dict(objective="grpo", **low)
        cases["smollm2_scgrpo_checkpointing"] = dict(objective="scgrpo", **low)
        for objective in ("grpo", "scgrpo"):  # 4-bit base (QLoRA), same checkpointing and micro-batches
            cases[f"smollm2_{objective}_qlora"] = dict(objective=objective, quantization="nf4", **low)
    elif args.suite == "qwen1p5b":  # 4 prompts x G=8, 512 completion tokens (forced), checkpointing
        qwen = random_qwen_folder(smollm2)
        common = dict(model=qwen, prompts=4, group=8, max_new=512, min_new=512, gradient_checkpointing=True,
                      micro_batch_size=8, coin_flip_rewards=True)
        for quant in ("nf4", None):
            for objective in ("grpo", "scgrpo"):
                cases[f"qwen1p5b_{objective}_{'qlora' if quant else 'bf16_lora'}"] = dict(
                    objective=objective, quantization=quant, **common)
    elif args.suite == "qwen8b":  # the paper's model size on a 24 GB card: 8 prompts x G=8, nf4 QLoRA, SC-GRPO
        qwen = random_qwen_folder(smollm2, args.shape, args.blocks)
        for mode in ("layers", "streamed", "resident"):  # 4-bit sampling, 64 rows: before (layers) and after
            sampling[f"qwen8b_sampling_{mode}"] = dict(four_bit=mode)
        sampling["qwen8b_sampling_streamed_whole"] = dict(four_bit="streamed", chunk=1 << 30)  # (the default)
        sampling["qwen8b_sampling_streamed_8m"] = dict(four_bit="streamed", chunk=1 << 23)  # in runs of 8M weights
        # streamed, the codes read inside the matmul (scgrpo.rollout.nf4_matmul; the default), or a dequantized scratch
        sampling["qwen8b_sampling_streamed_fused"] = dict(four_bit="streamed", kernel="fused")
        sampling["qwen8b_sampling_streamed_dequantize"] = dict(four_bit="streamed", kernel="dequantize")
        common = dict(model=qwen, objective="scgrpo", quantization="nf4", prompts=8, group=8, gradient_checkpointing=True,
                      coin_flip_rewards=True, keep_workspace=False)
        # 1,024 tokens with the targets' settings (micro-batches of 4 rows), peft's LoRA forward on the 4-bit layers
        # (lora.fused_4bit false); four_bit auto: resident on an 80 GB card
        cases["qwen8b_scgrpo_1k"] = dict(max_new=1024, min_new=1024, micro_batch_size=4, fused_lora=False, **common)
        # ... with the adapter terms of the 4-bit layers added by one addmm (LoraSettings.fused_4bit, the default)
        cases["qwen8b_scgrpo_1k_fused_lora"] = dict(max_new=1024, min_new=1024, micro_batch_size=4, **common)
        # ... without gradient checkpointing (an 80 GB card holds the activations of 2-row micro-batches)
        cases["qwen8b_scgrpo_1k_no_checkpointing"] = dict(common, max_new=1024, min_new=1024, micro_batch_size=2,
                                                          gradient_checkpointing=False, fused_lora=False)
        # ... fused adapter terms and no checkpointing, micro-batches of 4 rows (32.7 GiB allocated in the update, H100)
        cases["qwen8b_scgrpo_1k_fused_no_checkpointing"] = dict(common, max_new=1024, min_new=1024, micro_batch_size=4,
                                                                gradient_checkpointing=False)
        # the same step with the base in bf16 (no quantization): the bf16 level of the sampler-trainer mismatch
        cases["qwen8b_bf16_lora_scgrpo_1k"] = dict(common, max_new=1024, min_new=1024, micro_batch_size=4,
                                                   quantization=None)
        # ... and as before the 4-bit decode paths: the 4-bit layers' own forwards in the decode step
        cases["qwen8b_scgrpo_1k_layers"] = dict(max_new=1024, min_new=1024, micro_batch_size=4, four_bit="layers",
                                               steps=1, warmup=0, fused_lora=False, **common)
        # 24 GB consumer settings (configs/qlora_scgrpo_consumer.yaml): the process held to 20 GiB, the sampler
        # planning for it (streamed 4-bit base, KV cache in waves), micro-batches of 2 rows, logits in 512-token blocks
        consumer = dict(micro_batch_size=2, logprob_chunk_size=512, memory_budget_gib=20.0, memory_fraction_gib=20.0,
                        **common)
        cases["qwen8b_scgrpo_1k_20gib"] = dict(max_new=1024, min_new=1024, **consumer)
        # the package defaults within 20 GiB: the memory budget (its default read from the cap) sizes micro-batches,
        # log-prob chunks and checkpointing; GRPO beside it for SC-GRPO's overhead at this size
        auto = dict(common, gradient_checkpointing=None, memory_fraction_gib=20.0, max_new=1024, min_new=1024)
        cases["qwen8b_scgrpo_1k_20gib_auto"] = dict(auto)
        cases["qwen8b_grpo_1k_20gib_auto"] = dict(auto, objective="grpo")
        # ... the self-teacher's student and teacher rows in passes of their own (PassOptions.shared_teacher_passes off)
        cases["qwen8b_scgrpo_1k_20gib_auto_separate_teacher_passes"] = dict(auto, shared_teacher_passes=False)
        # ... the student's side by a forward pass in the teacher pass (generation.student_states "forward"), not
        # the sampler's kept states ("auto" at this length on a GPU)
        cases["qwen8b_scgrpo_1k_20gib_auto_forward_states"] = dict(auto, student_states="forward")
        for objective in ("grpo", "scgrpo"):  # ... the streamed 4-bit base through the fused nf4 matmul (the default), or
            # dequantized into a scratch and multiplied
            cases[f"qwen8b_{objective}_1k_20gib_auto_fused_nf4"] = dict(auto, objective=objective, stream_kernel="fused")
            cases[f"qwen8b_{objective}_1k_20gib_auto_dequantize_nf4"] = dict(auto, objective=objective,
                                                                             stream_kernel="dequantize")
        cases["qwen8b_scgrpo_4k_20gib"] = dict(max_new=4096, min_new=4096, steps=1, warmup=0, **consumer)
        if suffix:  # other blocks, other names: the summary's figures stay those of one kind of block
            cases = {k + suffix: v for k, v in cases.items()}
            sampling = {k + suffix: v for k, v in sampling.items()}
    else:  # FSDP throughput: same per-GPU batch on 1 and on N GPUs, fixed lengths
        common = dict(model=smollm2, prompts=16, group=8, max_new=128, min_new=128, devices=args.devices,
                      coin_flip_rewards=True)
        cases[f"fsdp_grpo_{args.devices}gpu"] = dict(objective="grpo", **common)
    wanted = set(filter(None, args.cases.split(",")))
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"bench_{args.suite}_{card_tag()}"
                                   f"{'_' + str(args.devices) + 'gpu' if args.suite == 'fsdp' else ''}.json")
    results = []

    def save() -> None:  # after each case: a cut run keeps the finished ones
        if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            payload = {"suite": args.suite, "card": card_name(), "gpus": torch.cuda.device_count(),
                       "versions": versions(), "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                                 os.environ.get("PYTORCH_ALLOC_CONF")),
                       "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                       "date": time.strftime("%Y-%m-%d"), "cases": results}
            with open(out, "w") as f:
                json.dump(payload, f, indent=1)

    unknown = wanted - set(cases) - set(sampling)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; this suite has {sorted(cases) + sorted(sampling)}")
    chosen = {k: v for k, v in sampling.items() if not wanted or k in wanted}
    if args.before_src and args.suite == "qwen8b" and chosen:  # first, while this process holds no model
        results.append(run_before(args.before_src, qwen, rows=64, group=8, new_tokens=args.sampling_tokens,
                                  repeats=args.repeats, case="qwen8b_sampling_before" + suffix))
        save()
    if chosen:
        results += run_sampling_cases(chosen, model=qwen, rows=64, group=8, new_tokens=args.sampling_tokens,
                                      repeats=args.repeats, profile=args.profile)
        save()
    if args.trl_result:
        results.append(trl_result(args.trl_result))
        save()
    order = [n for n in args.cases.split(",") if n in cases] if wanted else list(cases)  # as --cases lists them
    for name in order:
        kwargs = cases[name]
        print(f"== {name}", flush=True)
        if args.max_new:
            kwargs.update(max_new=args.max_new, min_new=min(kwargs.get("min_new", 0), args.max_new))
        kwargs = {"steps": args.steps, "warmup": args.warmup, **kwargs}
        snapshot = f"{args.memory_snapshot}.{name}.pkl" if args.memory_snapshot else None
        rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))
        profile = f"{args.profile}.{name}{'.rank' + str(rank) if rank else ''}.txt" if args.profile else None
        result = run_case(name, memory_snapshot=snapshot, profile=profile, **kwargs)
        results.append(result)
        brief = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k != "steps"}
        print(json.dumps(brief), flush=True)
        save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
