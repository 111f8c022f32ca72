"""``docs/gpu_tests.md`` from the JUnit file of a GPU test run (``scripts/gpu_tests.sh`` writes both).

    python scripts/gpu_tests_report.py build/gpu_tests.xml --out docs/gpu_tests.md

The page names the commit (``+changes`` where the tree had uncommitted changes), the card, the date, the versions of
torch, Triton, bitsandbytes, transformers and peft, the command, the counts, and a row per test: passed, failed,
error or skipped, with the first line of the failure or the skip's reason. Card and versions are read here, so run it
on the machine that ran the tests (``--card`` and ``--versions`` say them otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TESTS = "tests/gpu tests/rollout tests/distributed/test_fsdp.py"
"""The GPU set: every test that needs a card, beside the CPU tests of the same files"""
PACKAGES = ("torch", "triton", "bitsandbytes", "transformers", "peft")

INTRO = """# Tests that need a GPU

CI runs on a CPU: these tests skip there, each with its reason (`bash scripts/test.sh` lists them under
"skipped"). The kernel tests that do not need a GPU run in CI under Triton's interpreter; on a card the same files
also run their bf16, CUDA-graph and compiled variants, the engine's GPU tests and the sharded checks.

Run them on a GPU machine after any change to GPU code (`src/scgrpo/rollout/`, `policy.py`, `budget.py`,
`distributed.py`, the 4-bit paths) and before that change is called done: `bash scripts/gpu_tests.sh` runs the set
and writes this page from its JUnit file (`scripts/gpu_tests_report.py`)."""


@dataclass
class Case:
    name: str  # file::test[params]
    outcome: str  # passed, failed, error, skipped
    note: str = ""


def _first_line(text: Optional[str]) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:200].replace("|", "\\|")
    return ""


def read_junit(path: str) -> list[Case]:
    """Each ``<testcase>`` of a pytest JUnit file, in file order."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module.removeprefix('tests/')}.py::{case.get('name')}"
        outcome, note = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                note = _first_line(found.get("message")) or _first_line(found.text)
                break
        cases.append(Case(name, outcome, note))
    return cases


def commit() -> str:
    """This tree's commit (``+changes`` with uncommitted changes); ``SCGRPO_COMMIT`` where set (a copy of the tree
    whose git folder is not the tree's own, as on a machine the tree is sent to)."""
    if os.environ.get("SCGRPO_COMMIT"):
        return os.environ["SCGRPO_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def card() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            return f"{count}x {torch.cuda.get_device_name(0)}" if count > 1 else torch.cuda.get_device_name(0)
    except Exception:  # (no torch, or a broken driver: the page says so)
        pass
    return "no GPU"


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def page(cases: list[Case], card_name: str, version_line: str, at_commit: str, date: str, command: str) -> str:
    counts = {o: sum(c.outcome == o for c in cases) for o in ("passed", "failed", "error", "skipped")}
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no tests"
    lines = [INTRO, "", f"Last run: **{card_name}, {date}**, at commit {at_commit}; {version_line}.", "",
             "```bash", command, "```", "", f"That run: {summary}.", "",
             f"| test | {card_name}, {date} | note |", "|---|---|---|"]
    lines += [f"| `{c.name}` | {c.outcome if c.outcome == 'passed' else f'**{c.outcome}**'} | {c.note} |"
              for c in cases]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", help="the JUnit XML file pytest wrote (--junitxml)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "gpu_tests.md"))
    parser.add_argument("--card", default=None, help="the card's name (default: the one torch sees here)")
    parser.add_argument("--versions", default=None, help="the versions line (default: those installed here)")
    parser.add_argument("--commit", default=None, help="the commit tested (default: this tree's)")
    parser.add_argument("--command", default=f"bash scripts/gpu_tests.sh  # python -m pytest -q -rA {TESTS}")
    args = parser.parse_args(argv)
    cases = read_junit(args.junit)
    if not cases:
        print(f"{args.junit} holds no test case", file=sys.stderr)
        return 1
    text = page(cases, args.card or card(), args.versions or versions(), args.commit or commit(),
                datetime.date.today().isoformat(), args.command)
    Path(args.out).write_text(text)
    failed = sum(c.outcome in ("failed", "error") for c in cases)
    print(f"wrote {args.out}: {len(cases)} tests, {failed} failed or errored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
