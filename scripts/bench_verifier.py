"""Programs verified per second by PythonTests, for each sandbox mode that works on this machine.

    python scripts/bench_verifier.py --out benchmarks/results/bench_verifier_cpu.json
    git archive <commit> src | tar -x -C /tmp/before
    python scripts/bench_verifier.py --before /tmp/before --out benchmarks/results/bench_verifier_layers_cpu.json

Two workloads: a trivial program (one function, three call tests) and a program whose test busy-loops for
one second of CPU. Each mode runs ``--programs`` of each with ``workers`` = the number of cores, then the
latency of one trivial program verified alone (median of ``--latency-calls``). Writes the numbers as JSON and
prints a markdown table. ``--before``: an earlier source tree measured first, in a subprocess, by this same
script on this machine; the table then gives both and the latency's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import statistics
import subprocess
import tempfile

if "--src" in sys.argv:  # (the tree measured: an earlier one's src/ for --before)
    sys.path.insert(0, os.path.join(sys.argv[sys.argv.index("--src") + 1], "src"))
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from scgrpo.verifiers import PythonTests  # noqa: E402
from scgrpo.verifiers.sandbox import MODES, Sandbox, SandboxError  # noqa: E402

TRIVIAL = ("```python\ndef add(a, b):\n    return a + b\n```",
           [{"type": "call", "fn": "add", "args": [i, 1], "expected": i + 1} for i in range(3)])
BUSY = ("```python\nimport time\ndef spin():\n    end = time.process_time() + 1.0\n    while time.process_time() < end:\n"
        "        pass\n    return 1\n```", [{"type": "call", "fn": "spin", "args": [], "expected": 1}])


def bench(mode: str, programs: int, busy_programs: int, latency_calls: int) -> dict:
    verifier = PythonTests(isolation=mode, test_timeout_s=5.0, timeout_s=20.0, cpu_s=10)
    sandbox = verifier.sandbox
    out = {"mode": mode, "sandbox": sandbox.describe(), "workers": verifier.workers}
    for name, (code, tests), count in (("trivial", TRIVIAL, programs), ("busy_1s", BUSY, busy_programs)):
        start = time.perf_counter()
        results = verifier.verify_batch([code] * count, [tests] * count, ["q"] * count)
        elapsed = time.perf_counter() - start
        scores = [r.score for r in results]
        if scores != [1.0] * count:
            raise RuntimeError(f"{mode}/{name}: not every program passed: {results[:2]}")
        out[name] = {"programs": count, "seconds": round(elapsed, 3), "programs_per_s": round(count / elapsed, 2)}
    code, tests = TRIVIAL
    alone = []
    for _ in range(latency_calls):
        start = time.perf_counter()
        result = verifier.verify_batch([code], [tests], ["q"])[0]
        alone.append(time.perf_counter() - start)
        if result.score != 1.0:
            raise RuntimeError(f"{mode}/latency: the program did not pass: {result}")
    out["latency_s"] = round(statistics.median(alone), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=100)
    parser.add_argument("--busy-programs", type=int, default=8)
    parser.add_argument("--latency-calls", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/bench_verifier_cpu.json")
    parser.add_argument("--src", default=None, help="the source tree to measure (default: this one)")
    parser.add_argument("--before", default=None, help="an earlier source tree, measured first for comparison")
    args = parser.parse_args()
    before = None
    if args.before:
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "before.json")
            subprocess.run([sys.executable, __file__, "--src", args.before, "--programs", str(args.programs),
                            "--busy-programs", str(args.busy_programs), "--latency-calls", str(args.latency_calls),
                            "--out", out], check=True, stdout=subprocess.DEVNULL)
            before = json.load(open(out))
    rows, skipped = [], {}
    for mode in MODES:
        try:
            Sandbox(mode)
        except SandboxError as err:
            skipped[mode] = str(err)
            continue
        rows.append(bench(mode, args.programs, args.busy_programs, args.latency_calls))
    report = {"command": "python " + " ".join(sys.argv), "machine": platform.platform(), "cores": os.cpu_count(),
              "load_average_at_end": os.getloadavg(), "results": rows, "not_run": skipped}
    if before is not None:
        report["before"] = before
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    earlier = {row["mode"]: row for row in (before or {}).get("results", [])}
    print("| sandbox | trivial programs/s | 1 s busy-loop programs/s | one program alone, s |"
          + (" before: programs/s, alone s | alone, now / before |" if before else ""))
    print("|---|---|---|---|" + ("---|---|" if before else ""))
    for row in rows:
        line = (f"| {row['sandbox']} | {row['trivial']['programs_per_s']} | {row['busy_1s']['programs_per_s']} | "
                f"{row['latency_s']} |")
        old = earlier.get(row["mode"])
        if old is not None:
            line += (f" {old['trivial']['programs_per_s']}, {old['latency_s']} | "
                     f"{row['latency_s'] / old['latency_s']:.2f} |")
        print(line)
    for mode, why in skipped.items():
        print(f"| {mode} | not available: {why[:80]} | |")


if __name__ == "__main__":
    main()
