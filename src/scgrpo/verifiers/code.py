"""Code rewards: a completion's Python program run against its row's unit tests, in a sandbox.

The row's answer holds the tests, in any of these forms (a JSON string of them is read too):

* ``{"tests": [test, ...], "setup": "import math"}`` or a bare list of tests, each one of
  ``{"type": "call", "fn": "add", "args": [1, 2], "expected": 3}`` (function call with an expected value),
  ``{"type": "stdio", "input": "1 2\\n", "output": "3\\n"}`` (standard input and output, LiveCodeBench/APPS),
  ``{"type": "assert", "code": "assert add(1, 2) == 3"}``;
* a list of assert strings (MBPP's ``test_list``), or one string of test code (HumanEval's
  ``def check(candidate): ...`` followed by ``check(entry_point)``): each top-level ``assert`` and each call
  of a name that is not a builtin is one test, the rest is set-up;
* APPS' ``{"inputs": [...], "outputs": [...], "fn_name": ...}``; LiveCodeBench's
  ``[{"input": ..., "output": ..., "testtype": "stdin" | "functional"}]`` with ``fn_name`` beside them.

Expected values never enter the sandbox: the host compares what the program returned or printed. Assertions
run in the sandbox's judge process, never in the program's, with the program's functions as proxies.
"""

from __future__ import annotations

import ast
import json
import math
import os
import builtins
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Optional, Sequence, Union

from scgrpo.verifiers.base import VerificationResult, Verifier, VerifierSetupError
from scgrpo.verifiers.sandbox import MODES, Limits, Sandbox, result_value
from scgrpo.verifiers.sandbox_harness import encode

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced block tagged python (or py), else the last fenced block, else the whole text. A block
    left open (a truncated completion) runs to the end of the text."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    tagged = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    return (tagged or [body for _, body in blocks])[-1]


def _is_test(node: ast.stmt) -> bool:
    """An assertion, or a call of a name that is not a builtin (``check(candidate)``); docstrings,
    ``print(...)`` and ``random.seed(0)`` are not tests."""
    if isinstance(node, ast.Assert):
        return True
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
            and not hasattr(builtins, node.value.func.id))


def _from_code(source: str) -> tuple[list[dict[str, Any]], str]:
    """Top-level statements of test code: assertions and calls of the tests' own functions are tests, the
    rest (imports, definitions, assignments, other expressions) is set-up that runs before them."""
    tests, setup = [], []
    for node in ast.parse(source).body:
        statement = ast.get_source_segment(source, node) or ast.unparse(node)
        if _is_test(node):
            tests.append({"type": "assert", "code": statement})
        else:
            setup.append(statement)
    return tests, "\n".join(setup)


def _one_test(test: Any, fn_name: Optional[str]) -> dict[str, Any]:
    if isinstance(test, str):
        return {"type": "assert", "code": test}
    if not isinstance(test, dict):
        raise ValueError(f"a test must be a dict or an assert string, got {type(test).__name__}")
    kind = test.get("type") or test.get("testtype")
    if kind in ("stdin", "stdio") or (kind is None and "input" in test and "output" in test and not fn_name):
        if not isinstance(test.get("input"), str) or not isinstance(test.get("output"), str):
            raise ValueError("a stdio test needs string 'input' and 'output'")
        return {"type": "stdio", "input": test["input"], "output": test["output"]}
    if kind == "functional":  # LiveCodeBench: one JSON value per line of input
        if not fn_name:
            raise ValueError("a functional test needs fn_name")
        args = [json.loads(line) for line in test["input"].splitlines() if line.strip()]
        return {"type": "call", "fn": fn_name, "args": args, "expected": json.loads(test["output"])}
    if kind == "call" or (kind is None and "expected" in test):
        fn = test.get("fn") or fn_name
        if not fn or "expected" not in test:
            raise ValueError("a call test needs 'fn' and 'expected'")
        args = test.get("args") or []
        return {"type": "call", "fn": fn, "args": list(args), "kwargs": dict(test.get("kwargs") or {}),
                "expected": test["expected"]}
    if kind == "assert" or (kind is None and "code" in test):
        if not isinstance(test.get("code"), str):
            raise ValueError("an assert test needs a string 'code'")
        return {"type": "assert", "code": test["code"]}
    raise ValueError(f"unknown test {sorted(test)}; expected a call, stdio or assert test")


def processes_per_node() -> int:
    """Training processes on this machine, as torchrun (``LOCAL_WORLD_SIZE``) or SLURM (``SLURM_NTASKS_PER_NODE``,
    e.g. "8" or "8(x2)") says; 1 where neither does."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        match = re.match(r"\d+", os.environ.get(name, ""))
        if match and int(match.group()) > 0:
            return int(match.group())
    return 1


class ParsedTests(NamedTuple):
    """A row's tests as the verifier runs them."""

    tests: list[dict[str, Any]]
    """call, stdio and assert tests, expected values included"""
    setup: str
    """code the assert tests' namespace runs first (imports, ``def check``)"""
    entry_points: tuple[str, ...]
    """the functions under test, which a program may define even when they are named like builtins: the row's
    ``entry_point``/``fn_name``; else the builtin name HumanEval-style test code hands the ``check`` it defines
    (``check(max)``); else, when the tests read no name but builtins and their own (``assert max([1, 5, 2]) ==
    5``), the one builtin called in the most tests. Empty when the tests read a name of the program's (that is
    what they test); a row whose tests call two builtins equally often and name no entry point is refused (which
    of ``round`` and ``max`` does ``assert round(max(xs), 2) == 1.23`` test?)."""


def parse_tests(answer: Any) -> ParsedTests:
    """The tests, set-up and entry points from a row's answer in any of the module's forms; raises ValueError
    naming the problem for anything else."""
    tests, setup, fn_name = _parse(answer)
    return ParsedTests(tests, setup, (fn_name,) if fn_name else _guess_entry_points(tests, setup))


def _unresolved(trees: list[ast.AST]) -> tuple[set[str], set[str]]:
    """``(unresolved, bound)``: names the code reads that neither it (in the scope reading them, or an enclosing
    one) nor the builtins bind, that is the program's names it uses; and the names it binds at the top level.
    ``from m import *`` of a standard-library module binds that module's names; of another module, it makes
    every name unknown (``unresolved`` then holds ``*``)."""
    unresolved: set[str] = set()
    module = set().union(*(_binds(tree, top=True) for tree in trees))
    for tree in trees:
        _reads(tree, [module], unresolved)
    if "*" in module:
        unresolved.add("*")
    return {name for name in unresolved if name == "*" or not hasattr(builtins, name)}, module


def _binds(node: ast.AST, top: bool = False) -> set[str]:
    """Names bound in ``node``'s own scope (not in functions, lambdas or comprehensions inside it)."""
    names: set[str] = set()
    stack = list(ast.iter_child_nodes(node)) if not top else [node]
    while stack:
        child = stack.pop()
        if isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
            names.add(child.id)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
            stack.extend(child.decorator_list)
            continue  # their bodies are scopes of their own
        elif isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            for alias in child.names:
                if alias.name == "*":
                    names |= _star(getattr(child, "module", None))
                else:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
        elif isinstance(child, (ast.MatchAs, ast.MatchStar)) and child.name:
            names.add(child.name)
        elif isinstance(child, ast.MatchMapping) and child.rest:
            names.add(child.rest)
        stack.extend(ast.iter_child_nodes(child))
    return names


def _star(module: Optional[str]) -> set[str]:
    import importlib
    import sys

    if not module or module.split(".")[0] not in sys.stdlib_module_names:
        return {"*"}
    try:
        found = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a module this Python lacks: nothing known about its names
        return {"*"}
    return set(getattr(found, "__all__", None) or [n for n in dir(found) if not n.startswith("_")])


def _reads(node: ast.AST, scopes: list[set[str]], unresolved: set[str]) -> None:
    """Adds to ``unresolved`` the names ``node`` reads that no scope in ``scopes`` (innermost last) binds; functions,
    lambdas and comprehensions open scopes of their own."""
    if isinstance(node, ast.Name):
        if isinstance(node.ctx, ast.Load) and not any(node.id in scope for scope in scopes):
            unresolved.add(node.id)
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = node.args
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        for outer in args.defaults + [d for d in args.kw_defaults if d is not None] + getattr(node, "decorator_list", []):
            _reads(outer, scopes, unresolved)
        body = node.body if isinstance(node.body, list) else [node.body]
        inner = scopes + [params | set().union(*(_binds(part, top=True) for part in body))]
        for part in body:
            _reads(part, inner, unresolved)
        return
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        for generator in node.generators:
            _reads(generator.iter, scopes, unresolved)
        inner = scopes + [set().union(*(_binds(g.target, top=True) for g in node.generators))]
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for part in parts + [cond for g in node.generators for cond in g.ifs]:
            _reads(part, inner, unresolved)
        return
    for child in ast.iter_child_nodes(node):
        _reads(child, scopes, unresolved)


def _guess_entry_points(tests: list[dict[str, Any]], setup: str = "") -> tuple[str, ...]:
    """The entry points of tests whose row names none (see :attr:`ParsedTests.entry_points`): never a guess
    that could fail a right program."""
    try:
        trees = [ast.parse(setup)] + [ast.parse(t["code"]) for t in tests if t["type"] == "assert"]
    except SyntaxError:
        return ()
    functions = {n.name for tree in trees for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    handed = []
    for tree in trees[1:]:
        for node in tree.body:
            call = node.value if isinstance(node, ast.Expr) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in functions):
                continue
            given = call.args + [k.value for k in call.keywords]
            if len(given) == 1 and isinstance(given[0], ast.Name) and hasattr(builtins, given[0].id):
                handed.append(given[0].id)
    if handed:  # check(max): the tests' own function is handed what they test
        return tuple(dict.fromkeys(handed))
    unresolved, module = _unresolved(trees)
    if unresolved:
        return ()  # a name of the program's (called, or handed to map() or sorted()) is what they test
    counts: dict[str, int] = {}
    order = []
    for tree in trees[1:]:
        called = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id not in module and n.func.id not in functions]
        order += called
        for name in set(called):
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return ()
    most = max(counts.values())
    tied = [name for name in dict.fromkeys(order) if counts[name] == most]
    if len(tied) > 1:
        raise ValueError(f"the tests call only builtins ({', '.join(tied)}) and the row names no entry_point: "
                         "which one is under test?")
    return tuple(tied)


def _parse(answer: Any) -> tuple[list[dict[str, Any]], str, Optional[str]]:
    if isinstance(answer, str):
        text = answer.strip()
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            try:
                tests, setup = _from_code(text)
            except SyntaxError as err:
                raise ValueError(f"the tests are neither JSON nor Python: {err}") from None
            if not tests:
                raise ValueError("the test code has no assert or call statement")
            return tests, setup, None
    setup, fn_name = "", None
    if isinstance(answer, dict):
        setup = answer.get("setup") or answer.get("test_setup_code") or ""
        fn_name = answer.get("fn_name") or answer.get("entry_point")
        if "inputs" in answer and "outputs" in answer:  # APPS
            inputs, outputs = answer["inputs"], answer["outputs"]
            if fn_name:
                answer = [{"type": "call", "fn": fn_name, "args": i, "expected": o[0] if isinstance(o, list) and len(o) == 1
                           else o} for i, o in zip(inputs, outputs)]
            else:
                answer = [{"type": "stdio", "input": _text(i), "output": _text(o)} for i, o in zip(inputs, outputs)]
        elif "tests" in answer or "test_list" in answer or "test" in answer:
            inner = answer.get("tests", answer.get("test_list", answer.get("test")))
            if isinstance(inner, str) and not inner.lstrip().startswith("["):
                tests, more = _from_code(inner if not fn_name or "check(" not in inner or f"check({fn_name})" in inner
                                         else inner + f"\ncheck({fn_name})")
                return tests, "\n".join(s for s in (setup, more) if s), fn_name
            answer = json.loads(inner) if isinstance(inner, str) else inner
        else:
            answer = [answer]
    if not isinstance(answer, list) or not answer:
        raise ValueError(f"no tests found in {str(answer)[:80]!r}")
    return [_one_test(t, fn_name) for t in answer], setup, fn_name


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {_normalise_key(k): _normalise(v) for k, v in value.items()}
    return value


def _normalise_key(key: Any) -> Any:
    return tuple(_normalise(key)) if isinstance(key, (list, tuple)) else key


def values_equal(got: Any, expected: Any) -> bool:
    """Equality of plain values: tuples and lists alike (JSON has no tuples), floats within 1e-6 relative."""
    got, expected = _normalise(got), _normalise(expected)
    if isinstance(got, float) or isinstance(expected, float):
        if isinstance(got, (int, float)) and isinstance(expected, (int, float)) and not isinstance(got, bool):
            try:
                return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
            except OverflowError:  # an int past any float (10**400): not within 1e-6 of a float
                return False
        return False
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected))
    return type(got) is type(expected) and got == expected or (
        isinstance(got, (int, bool)) and isinstance(expected, (int, bool)) and got == expected)


def output_equal(got: str, expected: str) -> bool:
    """Standard output compared line by line, trailing spaces and trailing empty lines ignored; anything but text
    (a reply the program forged) is not equal."""
    if not isinstance(got, str):
        return False
    lines = lambda text: [line.rstrip() for line in text.strip("\n").splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


class PythonTests(Verifier):
    """Runs the completion's Python code against the row's unit tests and scores the share that pass.

    The code is the completion's last fenced block (or the whole text). Each program runs in its own sandbox
    (see :mod:`scgrpo.verifiers.sandbox`; the one chosen is logged once); ``workers`` programs run at a time.
    A program that hangs, crashes, or exits early fails the tests it did not finish; its ``info`` lists each
    test's outcome (``pass``, ``wrong``, ``timeout``, ``error: ...``).

    Args:
        all_or_nothing: score 1 only when every test passes (else the share passed).
        isolation: ``auto`` (the strongest that works: ``bwrap``, then ``namespaces``, then ``process``), or
            one of them. A sandbox that cannot be set up raises
            :class:`~scgrpo.verifiers.sandbox.SandboxError`, which stops the run.
        workers: programs run at a time (0 = the machine's cores over the training processes it runs: torchrun's
            ``LOCAL_WORLD_SIZE``, SLURM's tasks per node).
        timeout_s: wall-clock seconds for one program and all its tests.
        test_timeout_s: wall-clock seconds for one test.
        cpu_s / memory_mb / processes / file_mb / disk_mb / disk_files / open_files / output_kb: see
            :class:`scgrpo.verifiers.sandbox.Limits`.
    """

    def __init__(
        self,
        all_or_nothing: bool = False,
        isolation: str = "auto",
        workers: int = 0,
        timeout_s: float = 10.0,
        test_timeout_s: float = 2.0,
        cpu_s: int = 5,
        memory_mb: int = 1024,
        processes: int = 32,
        file_mb: int = 16,
        disk_mb: int = 64,
        disk_files: int = 4096,
        open_files: int = 64,
        output_kb: int = 1024,
    ) -> None:
        if isolation not in ("auto", *MODES):
            raise ValueError(f"isolation={isolation!r}: expected one of auto, {', '.join(MODES)}")
        self.all_or_nothing = all_or_nothing
        self.limits = Limits(timeout_s=timeout_s, test_timeout_s=test_timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                             processes=processes, file_mb=file_mb, disk_mb=disk_mb, disk_files=disk_files,
                             open_files=open_files, output_kb=output_kb)
        self.isolation = isolation
        self.workers = workers or max((os.cpu_count() or 1) // processes_per_node(), 1)
        self.timeout_s = None  # the sandbox enforces its own limits; the runner's alarm would not kill programs
        self._sandbox: Optional[Sandbox] = None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(self.isolation, self.limits)
        return self._sandbox

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_sandbox"] = None
        return state

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        (result,) = self.verify_batch([completion], [answer], [question])
        if isinstance(result, Exception):
            raise result
        return result

    def verify_batch(
        self, completions: Sequence[str], answers: Sequence[Any], questions: Sequence[str]
    ) -> list[Union[VerificationResult, Exception]]:
        """Scores many completions, ``workers`` sandboxes at a time. A row whose tests cannot be read gives its
        ValueError in place of a result (the runner counts and logs it); a sandbox that cannot be set up raises."""
        sandbox = self.sandbox
        with ThreadPoolExecutor(max_workers=min(self.workers, max(len(completions), 1))) as pool:
            futures = [pool.submit(self._one, sandbox, c, a) for c, a in zip(completions, answers)]
            out: list[Union[VerificationResult, Exception]] = []
            for future in futures:
                try:
                    out.append(future.result())
                except VerifierSetupError:
                    raise
                except Exception as err:
                    out.append(err)
            return out

    def _one(self, sandbox: Sandbox, completion: str, answer: Any) -> VerificationResult:
        tests, setup, entry_points = parse_tests(answer)
        code = extract_code(completion)
        sent = []
        for test in tests:  # what the sandbox sees: no expected values
            if test["type"] == "call":
                sent.append({"type": "call", "fn": test["fn"], "args": encode(list(test["args"])),
                             "kwargs": encode(dict(test.get("kwargs") or {}))})
            elif test["type"] == "stdio":
                sent.append({"type": "stdio", "input": test["input"]})
            else:
                sent.append(test)
        outcome = sandbox.run(code, sent, setup, entry_points)
        if outcome.results is None:
            outcomes = [outcome.failure or "no verdict"] * len(tests)
        else:
            outcomes = [self._judge(test, result) for test, result in zip(tests, outcome.results)]
        passed = sum(o == "pass" for o in outcomes)
        score = float(passed == len(tests)) if self.all_or_nothing else passed / len(tests)
        return VerificationResult(score, {"passed": passed, "total": len(tests), "tests": outcomes,
                                          "sandbox": sandbox.describe()})

    @staticmethod
    def _judge(test: dict[str, Any], result: dict[str, Any]) -> str:
        if "passed" in result:  # an assert: the judge's verdict, with its reason when not a failed assertion
            error = str(result.get("error") or "")
            if result["passed"] is True:
                return "pass"
            return "wrong" if not error or error.startswith("AssertionError") else f"error: {error}"[:120]
        if result.get("error"):
            return "timeout" if result["error"] == "timeout" else f"error: {result['error']}"[:120]
        if test["type"] == "call":
            try:
                return "pass" if values_equal(result_value(result), test["expected"]) else "wrong"
            except (KeyError, TypeError, ValueError, RecursionError):
                return "error: unreadable value"
        if result.get("truncated"):
            return "error: output too long"
        return "pass" if output_equal(result.get("stdout", ""), test["output"]) else "wrong"
