"""Mutation testing of the update math: how many small bugs planted in the code the tests catch.

Runs mutmut (``pip install -e .[mutation]``) in two passes, each in a scratch copy of ``src/`` and ``tests/``
under ``build/mutation/<pass>/`` (mutmut writes its mutated tree, ``mutants/``, there):

- ``fast``: every function of ``src/scgrpo/objectives/``, ``selfteacher.py``, ``data/buffer.py`` and
  ``verifiers/numeric.py``, each mutant against the fast unit tests that reach it;
- ``update``: ``update.py`` and ``guard.py`` (the step's update and divergence guard), each mutant against their
  unit tests and the module tests that reach it (tiny models trained for a step);
- ``buffer``: every mutant of ``data/buffer.py`` (the verified-trajectory buffer) against its tests and the data
  module's;
- ``sandbox``: the host side of the code sandbox's bounds (``verifiers/cgroup.py``, ``verifiers/sandbox.py``) against
  ``tests/verifiers/test_kernel_bounds.py`` and ``tests/verifiers/test_cgroup.py``;
- ``module``: the same code where it lived before it had files of its own, the update and guard methods of
  ``RLVRModule`` (``MODULE_METHODS``), for measuring an older tree.

The passes share ``[tool.mutmut]`` of pyproject.toml; a pass's own table (``[tool.mutmut.fast]``,
``[tool.mutmut.module]``) is laid over it in the scratch copy's pyproject. Test files a pass names that do
not exist (an older tree) are left out. Writes per target: total, killed, survived, timeout, skipped,
no_tests (mutants no selected test reaches; they count as not caught), score = (killed + timeout) /
(total - skipped), and lists the survivors with their diffs beside the results (``--survivors``).

``--sample K`` runs one mutant in K (those whose name hashes to 0 mod K: the same mutants on every tree
with the same source), for machines where the whole set takes hours. ``--caught-in earlier.json`` takes the
mutants an earlier run of the same source caught as caught and runs only the rest: tests are only ever added,
so a caught mutant stays caught.

    python3 scripts/mutation.py --out benchmarks/results/mutation/2026-11-27-after.json
    python3 scripts/mutation.py --passes fast --sample 5 --caught-in benchmarks/results/mutation/2026-11-27-before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SEP = "\u01c1"  # mutmut's class separator in mutant names ("xǁClassǁmethod")

MODULE_METHODS = (
    "training_step", "nonfinite_inputs", "_on_any_rank", "_clip_gradients", "_keep_good_weights",
    "restore_good_weights", "_count_skip", "plan_step", "accumulate_gradients", "_micro_forward",
    "_sampler_correction", "_mismatch_metrics", "_score_rollouts", "_batch_entropy",
)
"""The RLVRModule methods measured by the module pass"""

TARGETS = {  # target name -> (pass, module prefix of its mutant names)
    "objectives": ("fast", "scgrpo.objectives."),
    "selfteacher.py": ("fast", "scgrpo.selfteacher."),
    "data/buffer.py": ("fast", "scgrpo.data.buffer."),
    "verifiers/numeric.py": ("fast", "scgrpo.verifiers.numeric."),
    "module.py (update/guard methods)": ("module", "scgrpo.module."),
    "update.py": ("update", "scgrpo.update."),
    "verifiers/cgroup.py": ("sandbox", "scgrpo.verifiers.cgroup."),
    "verifiers/sandbox.py": ("sandbox", "scgrpo.verifiers.sandbox."),
    "guard.py": ("update", "scgrpo.guard."),
    "stage.py": ("stage", "scgrpo.stage."),
    "callbacks/rollout.py": ("stage", "scgrpo.callbacks.rollout."),
}

KILLED, SURVIVED, TIMEOUT, NO_TESTS, SKIPPED = "killed", "survived", "timeout", "no_tests", "skipped"
STATUS = {1: KILLED, 3: KILLED, 0: SURVIVED, 5: NO_TESTS, 33: NO_TESTS, 34: SKIPPED, 36: TIMEOUT, -24: TIMEOUT,
          24: TIMEOUT, 152: TIMEOUT, 255: TIMEOUT, 37: KILLED}
"""mutmut's exit codes (mutmut/stats.py); anything else (a crash, a segfault) counts as not caught"""


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def pass_config(name: str) -> dict:
    """``[tool.mutmut]`` with the pass's own table laid over it; test paths that do not exist are dropped."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    base = {k: v for k, v in tool["mutmut"].items() if not isinstance(v, dict)}
    config = {**base, **tool["mutmut"][name]}
    selection, args = [], list(config.get("pytest_add_cli_args_test_selection", []))
    for i, arg in enumerate(args):
        is_path = arg.startswith("tests/") and (i == 0 or args[i - 1] != "--deselect")
        if not is_path or (ROOT / arg.split("::")[0]).exists():
            selection.append(arg)
    config["pytest_add_cli_args_test_selection"] = selection
    return config


def prepare(name: str) -> Path:
    """A scratch copy of the project for one pass: src/, tests/, configs/, scripts/, the README and a pyproject.toml
    with the pass's config."""
    scratch = ROOT / "build" / "mutation" / name
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", scratch / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", scratch / "tests", ignore=ignore)
    shutil.copytree(ROOT / "configs", scratch / "configs", ignore=ignore)  # tests build objectives from them
    shutil.copytree(ROOT / "scripts", scratch / "scripts", ignore=ignore)  # and load scripts (weight_shares, ...)
    shutil.copy2(ROOT / "README.md", scratch / "README.md")  # and run its examples
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ["[tool.pytest.ini_options]"] + [f"{k} = {toml_value(v)}" for k, v in pytest_options.items()]
    lines += ["", "[tool.mutmut]"] + [f"{k} = {toml_value(v)}" for k, v in pass_config(name).items()]
    (scratch / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return scratch


def patterns(name: str) -> list[str]:
    if name == "module":
        return [f"scgrpo.module.x{SEP}RLVRModule{SEP}{m}__mutmut_*" for m in MODULE_METHODS]
    return []  # every mutant of the pass's files


def target_of(key: str) -> str | None:
    for target, (name, prefix) in TARGETS.items():
        if key.startswith(prefix):
            if name == "module":
                method = key.split(SEP)[-1].rpartition("__mutmut_")[0] if SEP in key else ""
                return target if method in MODULE_METHODS else None
            return target
    return None


def collect(scratch: Path) -> dict[str, dict[str, str]]:
    """Mutant name -> status, per target, from mutmut's meta files."""
    out: dict[str, dict[str, str]] = {}
    for meta in sorted((scratch / "mutants" / "src").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for key, code in codes.items():
            target = target_of(key)
            if target is None:
                continue
            status = STATUS.get(code, "not_checked" if code is None else f"exit_{code}")
            out.setdefault(target, {})[key] = status
    return out


def summarise(statuses: dict[str, str]) -> dict:
    counts = {s: 0 for s in (KILLED, SURVIVED, TIMEOUT, SKIPPED, NO_TESTS)}
    other = 0
    for status in statuses.values():
        if status in counts:
            counts[status] += 1
        else:
            other += 1
    total = len(statuses)
    caught = counts[KILLED] + counts[TIMEOUT]
    denominator = total - counts[SKIPPED]
    return {"total": total, **counts, "other": other,
            "score": round(caught / denominator, 4) if denominator else None}


def sampled(key: str, k: int) -> bool:
    return k <= 1 or int(hashlib.sha1(key.encode()).hexdigest(), 16) % k == 0


PASS_ENV = {"sandbox": {"SCGRPO_REQUIRE_SANDBOX": "bwrap,namespaces"}}
"""A pass's environment: the sandbox tests skip a mode that does not start, which would let every mutant that breaks
the mode survive; in the sandbox pass they fail instead (run it where both modes work)"""


def mutmut(scratch: Path, max_children: int, names: list[str], name: str = "") -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/src first itself
    env.update(PASS_ENV.get(name, {}))
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *names]
    shown = " ".join(cmd[:6]) + (f" <{len(names)} mutant names>" if len(names) > 20 else " " + " ".join(names))
    print("$", shown, f"(in {scratch.relative_to(ROOT)})", flush=True)
    subprocess.run(cmd, cwd=scratch, env=env, check=False)


def run_pass(name: str, max_children: int, sample: int, caught: set[str], resume: bool) -> tuple[dict, float]:
    """Generates the pass's mutants and the test associations (mutmut's stats run), then runs the chosen
    mutants: those of the pass's targets, one in ``sample``, less the ones in ``caught``. ``resume``: go on
    in the pass's scratch copy of an interrupted run (mutants with a result keep it)."""
    scratch = ROOT / "build" / "mutation" / name
    start = time.time()
    done: dict[str, str] = {}
    if resume and (scratch / "mutants" / "mutmut-stats.json").exists():
        done = {k: s for statuses in collect(scratch).values() for k, s in statuses.items() if s != "not_checked"}
    else:
        prepare(name)
        mutmut(scratch, max_children, ["no-such-mutant-*"], name)  # mutants and stats only: the filter matches nothing
    stats = json.loads((scratch / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    chosen = {t: {k: s for k, s in statuses.items() if sampled(k, sample)} for t, statuses in collect(scratch).items()}
    to_run = []
    for statuses in chosen.values():
        for key in statuses:
            if key in caught:
                statuses[key] = KILLED
            elif not stats.get(key.rpartition("__mutmut_")[0]):
                statuses[key] = NO_TESTS  # no selected test reaches the function
            elif key in done:
                statuses[key] = done[key]
            else:
                to_run.append(key)
    if to_run:
        mutmut(scratch, max_children, sorted(to_run), name)
    measured = collect(scratch)
    for target, statuses in chosen.items():
        for key in statuses:
            if key in to_run:
                statuses[key] = measured[target][key]
    return chosen, time.time() - start


def survivors_report(scratch: Path, names: list[str]) -> str:
    parts = []
    for key in names:
        shown = subprocess.run([sys.executable, "-m", "mutmut", "show", key], cwd=scratch, capture_output=True,
                               text=True)
        parts.append(f"## {key}\n{shown.stdout.strip()}\n")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", nargs="+", default=["fast", "update"], choices=["fast", "update", "module", "sandbox", "buffer", "stage"])
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--out", type=Path, help="results JSON (per target: counts and score)")
    parser.add_argument("--survivors", type=Path, help="write the surviving mutants' diffs here")
    parser.add_argument("--label", default="", help="what tree was measured (e.g. 'before', 'after')")
    parser.add_argument("--sample", type=int, default=1, help="run one mutant in K (default: all)")
    parser.add_argument("--caught-in", type=Path, help="results JSON of an earlier run of the same source")
    parser.add_argument("--resume", action="store_true", help="go on with an interrupted run's scratch copies")
    args = parser.parse_args()
    caught: set[str] = set()
    if args.caught_in:
        earlier = json.loads(args.caught_in.read_text())
        caught = {k for k, s in earlier["mutants"].items() if s in (KILLED, TIMEOUT)}
    # the tree measured: its commit when the pass copies it (a later commit during a long run would misname it)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src", "tests"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    results, survivors, seconds, everything = {}, [], {}, {}
    for name in args.passes:
        per_target, elapsed = run_pass(name, args.max_children, args.sample, caught, args.resume)
        seconds[name] = round(elapsed)
        for target, statuses in per_target.items():
            results[target] = summarise(statuses)
            everything.update(statuses)
            survivors += [(name, k) for k, s in sorted(statuses.items()) if s not in (KILLED, TIMEOUT, SKIPPED)]
    report = {
        "label": args.label,
        "commit": commit + ("+changes" if dirty else ""),
        "command": "python3 scripts/mutation.py " + " ".join(sys.argv[1:]),
        "tool": "mutmut " + subprocess.run([sys.executable, "-m", "pip", "show", "mutmut"], capture_output=True,
                                           text=True).stdout.split("Version: ")[-1].split("\n")[0],
        "seconds_per_pass": seconds,
        "targets": results,
        "sample": f"1 in {args.sample}" if args.sample > 1 else "all",
        "caught_in": str(args.caught_in) if args.caught_in else None,
        "overall": summarise(everything),
        "survivors": [k for _, k in survivors],
        "mutants": dict(sorted(everything.items())),
    }
    print(json.dumps({k: v for k, v in report.items() if k not in ("survivors", "mutants")}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.survivors:
        text = "\n".join(survivors_report(ROOT / "build" / "mutation" / name, [k for n, k in survivors if n == name])
                         for name in args.passes)
        args.survivors.write_text(text)


if __name__ == "__main__":
    main()
