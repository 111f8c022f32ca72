"""PythonTests: code extraction, the test formats it reads, scoring, and the parallel batch path."""

import json
import os

import pytest

from scgrpo.verifiers import PythonTests, VerifierRunner
from scgrpo.verifiers.code import extract_code, output_equal, parse_tests, values_equal
from scgrpo.verifiers.sandbox import Sandbox, SandboxError

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
CALLS = {"tests": [{"type": "call", "fn": "add", "args": [1, 2], "expected": 3},
                   {"type": "call", "fn": "add", "args": [[1], [2]], "expected": [1, 2]},
                   {"type": "call", "fn": "add", "args": [-1, 1], "expected": 0}]}

SETUP_STATEMENTS = '"""hidden tests"""\nimport random\nrandom.seed(0)\nprint("checking")\nassert add(1, 2) == 3\n'


@pytest.fixture(scope="module")
def verifier():
    return PythonTests(test_timeout_s=1.0, timeout_s=6.0, cpu_s=2, memory_mb=512)


def test_extract_code_prefers_the_last_python_block():
    text = "Idea:\n```\nnot this\n```\n```python\nfirst = 1\n```\nthen\n```py\nsecond = 2\n```\n"
    assert extract_code(text).strip() == "second = 2"
    assert extract_code("```python\ndef f():\n    return 1").strip() == "def f():\n    return 1"  # left open
    assert extract_code("def f(): return 1") == "def f(): return 1"
    assert extract_code("```\nx = 1\n```").strip() == "x = 1"


def test_parse_tests_reads_every_format():
    tests, setup, entry = parse_tests(json.dumps(CALLS))
    assert [t["type"] for t in tests] == ["call"] * 3 and tests[0]["expected"] == 3 and setup == "" and entry == ()
    mbpp, _, entry = parse_tests(["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    assert [t["code"] for t in mbpp] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"] and entry == ()
    # no entry point given: builtin names called by every test, or handed to check(), are what is tested
    assert parse_tests(["assert max([1, 5]) == 5", "assert len([max([0])]) == 1"]).entry_points == ("max",)
    assert parse_tests("def check(candidate):\n    assert candidate([1]) == 1\n\ncheck(max)").entry_points == ("max",)
    with pytest.raises(ValueError, match=r"only builtins \(round, max\) and the row names no entry_point"):
        parse_tests(["assert round(max([1.5]), 1) == 1.5"])  # which one is tested?
    # a name of the program's, called or handed to a builtin, is what is tested: no builtin is guessed
    for tests in (["assert set(common([1], [1])) == {1}"], ["assert Solution().add(1, 2) == 3"],
                  ["assert list(map(square, [1, 2])) == [1, 4]"], ["assert sorted(['bb', 'a'], key=size) == ['a', 'bb']"],
                  "input = [3, 1, 2]\nbubble(input)\nassert bubble(input) == [1, 2, 3]",
                  # a lambda's parameter binds count in the lambda only: the test's other count is the program's
                  ["assert count(['a']) == 1", "assert all((lambda count: count > 0)(c) for c in [1])"],
                  {"tests": ["assert max([foo]) == foo"], "setup": "from numpy import *"}):  # names unknown
        assert parse_tests(tests).entry_points == (), tests
    assert parse_tests({"tests": ["assert max([pi, 1]) == pi"], "setup": "from math import *"}).entry_points == ("max",)
    assert parse_tests("def check(candidate):\n    assert candidate([1]) == 1\n\ncheck(candidate=max)").entry_points == (
        "max",)
    human, setup, entry = parse_tests({"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
                                       "entry_point": "add"})
    assert [t["code"] for t in human] == ["check(add)"] and setup.startswith("def check") and entry == ("add",)
    apps, *_ = parse_tests({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    assert apps == [{"type": "stdio", "input": "1 2\n", "output": "3\n"}]
    apps_fn, *_ = parse_tests({"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"})
    assert apps_fn[0]["expected"] == 3 and apps_fn[0]["fn"] == "add"
    lcb, _, entry = parse_tests({"tests": json.dumps([{"input": "1\n2", "output": "3", "testtype": "functional"},
                                                      {"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
                                 "fn_name": "add"})
    assert lcb[0] == {"type": "call", "fn": "add", "args": [1, 2], "expected": 3}
    assert lcb[1]["type"] == "stdio" and entry == ("add",)
    code, setup, _ = parse_tests("import math\nassert add(1, 1) == 2\nassert add(2, 2) == 4\n")
    assert len(code) == 2 and setup == "import math"
    code, setup, _ = parse_tests(SETUP_STATEMENTS)  # a docstring, print(...), random.seed(0) are not tests
    assert [t["code"] for t in code] == ["assert add(1, 2) == 3"] and setup == SETUP_STATEMENTS.rsplit("\nassert", 1)[0]


@pytest.mark.parametrize("bad, message", [
    ("", "no assert"), ("[]", "no tests"), ("def (:", "neither JSON nor Python"), ([{"type": "call", "fn": "f"}], "expected"),
    ([{"type": "stdio", "input": 1, "output": "x"}], "string"), ([{"what": 1}], "unknown test"), ("x = 1", "no assert"),
    ([3], "dict or an assert string"),
])
def test_malformed_tests_name_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(bad)


def test_value_comparison_is_strict_about_types_but_not_tuples():
    assert values_equal((1, 2), [1, 2]) and values_equal(0.1 + 0.2, 0.3) and not values_equal("1", 1)
    assert not values_equal([1, 2], [1, 2, 3]) and not values_equal(None, 0) and values_equal({"a": (1,)}, {"a": [1]})
    assert output_equal("3  \n4\n\n", "3\n4") and not output_equal("3 4", "3\n4")
    # what a program can forge: an int past any float where a float is expected, output that is not text
    assert not values_equal(10**400, 1.5) and not values_equal(1.5, 10**400) and not values_equal([10**400], [2.0])
    assert not output_equal({"dict": []}, "3") and not output_equal(None, "")


def test_scores_the_share_of_tests_passed_and_lists_outcomes(verifier):
    half = "```python\ndef add(a, b):\n    return a + b if a != -1 else 7\n```"
    results = verifier.verify_batch([ADD, half, "no code at all"], [CALLS] * 3, ["q"] * 3)
    assert results[0].score == 1.0 and results[0].info["tests"] == ["pass", "pass", "pass"]
    assert results[1].score == pytest.approx(2 / 3) and results[1].info["tests"][2] == "wrong"
    assert results[2].score == 0.0 and results[2].info["tests"][0].startswith("error: ")
    strict = PythonTests(all_or_nothing=True, test_timeout_s=1.0)
    assert strict.verify(half, CALLS).score == 0.0 and strict.verify(ADD, CALLS).score == 1.0


def test_stdio_and_assert_tests(verifier):
    stdio = [{"type": "stdio", "input": "1 2\n", "output": "3\n"}, {"type": "stdio", "input": "10 5\n", "output": "15"}]
    program = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"
    via_open = "```python\na, b = map(int, open(0).read().split())\nprint(a + b)\nraise SystemExit\n```"
    asserts = "def check(candidate):\n    assert candidate(2, 2) == 4\n    assert candidate(-1, 1) == 0\n"
    zero = "```python\ndef add(a, b):\n    return 0\n```"
    results = verifier.verify_batch(
        [program, via_open, ADD, "```python\ndef add(a, b):\n    return 4\n```", ADD, zero],
        [stdio, stdio, {"test": asserts, "entry_point": "add"}, {"test": asserts, "entry_point": "add"},
         SETUP_STATEMENTS, SETUP_STATEMENTS], ["q"] * 6)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]  # set-up statements count as no test


def test_a_slow_test_times_out_and_the_others_still_count(verifier):
    code = "```python\ndef add(a, b):\n    while a == 5:\n        pass\n    return a + b\n```"
    tests = [{"type": "call", "fn": "add", "args": [5, 1], "expected": 6}, {"type": "call", "fn": "add", "args": [1, 1], "expected": 2}]
    result = verifier.verify(code, tests)
    assert result.info["tests"] == ["timeout", "pass"] and result.score == 0.5


def test_runner_counts_malformed_rows_as_errors_and_scores_the_rest(verifier, caplog):
    runner = VerifierRunner(verifier)
    results = runner([ADD, ADD], [CALLS, "not tests ((("], ["q", "q"], ["good", "bad-row"])
    assert [r.score for r in results] == [1.0, 0.0] and runner.errors == 1
    assert "bad-row" in caplog.text and "neither JSON nor Python" in caplog.text


def test_leetcode_style_solution_classes_are_called_like_functions(verifier):
    """LiveCodeBench and APPS write function problems as ``class Solution`` methods."""
    program = ("```python\nclass Solution:\n    def maxSum(self, nums, k):\n        return sum(sorted(nums)[-k:])\n"
               "    def helper(self):\n        return None\n```")
    wrong = "```python\nclass Solution:\n    def maxSum(self, nums, k):\n        return 0\n```"
    livecodebench = {"tests": json.dumps([{"input": "[1, 5, 3]\n2", "output": "8", "testtype": "functional"},
                                          {"input": "[4]\n1", "output": "4", "testtype": "functional"}]),
                     "testtype": "functional", "fn_name": "maxSum"}
    apps = {"inputs": [[[1, 5, 3], 2], [[2, 2], 1]], "outputs": [[8], [2]], "fn_name": "maxSum"}
    results = verifier.verify_batch([program, program, wrong], [livecodebench, apps, apps], ["q"] * 3)
    assert [r.info["tests"] for r in results] == [["pass", "pass"], ["pass", "pass"], ["wrong", "wrong"]]


def test_a_misspelt_isolation_fails_at_once_and_a_broken_sandbox_stops_the_run():
    with pytest.raises(ValueError, match="isolation='bwarp': expected one of auto, bwrap, namespaces, process"):
        PythonTests(isolation="bwarp")

    class Broken(PythonTests):
        def verify_batch(self, completions, answers, questions):
            raise SandboxError("no sandbox works here: bwrap: not installed")

    with pytest.raises(SandboxError, match="no sandbox works here"):
        VerifierRunner(Broken())([ADD], [CALLS], ["q"], ["id"])


def test_as_root_the_program_never_runs_as_root(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("runs as root only")
    monkeypatch.setattr(Sandbox, "_python_reachable_by_others", lambda self: False)
    with pytest.raises(SandboxError, match="no sandbox works here: process: running as root, the program must run "
                                           "as another user"):
        Sandbox("process")


def test_the_process_mode_makes_the_trainer_undumpable():
    import ctypes

    from scgrpo.verifiers.sandbox import _make_undumpable

    pid = os.fork()
    if pid == 0:  # in a child, so that this process stays as it was
        libc = ctypes.CDLL(None)
        before = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        _make_undumpable()
        os._exit(10 * before + libc.prctl(3, 0, 0, 0, 0))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 10  # dumpable before, not after


def test_subclasses_of_plain_types_cross_as_plain_data():
    """A Counter, a namedtuple or a numpy integer is the right answer's value, not a foreign object."""
    # loading the program (its numpy import) gets a test's time limit, and a load that runs out of it fails every
    # test: a limit that a cold import on a loaded machine keeps (the module's 1 s did not, once)
    verifier = PythonTests(test_timeout_s=10.0, timeout_s=40.0, cpu_s=5, memory_mb=512)
    tests = [{"type": "call", "fn": "counts", "args": ["aab"], "expected": {"a": 2, "b": 1}},
             {"type": "call", "fn": "point", "args": [], "expected": [1, 2]},
             {"type": "call", "fn": "total", "args": [[1, 2]], "expected": 3},
             {"type": "call", "fn": "color", "args": [], "expected": "red"},
             {"type": "assert", "code": "assert point().x == 1"},
             {"type": "assert", "code": "assert counts('aab') == {'a': 2, 'b': 1} and point() == (1, 2)"}]
    program = ("```python\nimport collections\nimport enum\nimport numpy\nPoint = collections.namedtuple('Point', 'x y')\n"
               "class Color(str, enum.Enum):\n    RED = 'red'\n    BLUE = 'blue'\n"
               "def color():\n    return Color.RED if {} == 1 else Color.BLUE\n"
               "def counts(s):\n    return collections.Counter(s)\ndef point():\n    return Point({}, 2)\n"
               "def total(xs):\n    return numpy.array(xs).sum() + {}\n```")
    right, wrong = program.format(1, 1, 0), program.format(2, 2, 1)
    results = verifier.verify_batch([right, wrong], [tests, tests], ["q"] * 2)
    # a namedtuple crosses as a tuple: its field names stay in the program (the test's error is its outcome)
    no_field = "error: AttributeError: 'tuple' object has no attribute 'x'"
    assert results[0].info["tests"] == ["pass", "pass", "pass", "pass", no_field, "pass"], results[0].info
    assert results[1].info["tests"] == ["pass", "wrong", "wrong", "wrong", no_field, "wrong"], results[1].info


def test_program_exceptions_reach_tests_as_their_nearest_builtin_class(verifier):
    """A subclass of ValueError satisfies ``except ValueError``; StopIteration never silently ends a map() in a
    test (it arrives as a RuntimeError)."""
    tests = {"tests": ["assert all(map(is_even, [2, 4, 6]))", "assert not any(map(is_even, [1, 3]))",
                       "assert list(filter(is_even, [1, 3, 5])) == []"], "fn_name": "is_even"}
    raising = "```python\ndef is_even(x):\n    raise StopIteration\n```"
    right = "```python\ndef is_even(x):\n    return x % 2 == 0\n```"
    expects = {"tests": ["try:\n    parse('x')\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok"],
               "fn_name": "parse"}
    subclass = "```python\nclass Bad(ValueError):\n    pass\ndef parse(s):\n    raise Bad(s)\n```"
    own = "```python\nclass ValueError(Exception):\n    pass\ndef parse(s):\n    raise ValueError(s)\n```"
    results = verifier.verify_batch([raising, right, subclass, own], [tests, tests, expects, expects], ["q"] * 4)
    assert [r.score for r in results] == [0.0, 1.0, 1.0, 0.0]


def test_a_handle_neither_compares_nor_hashes_nor_outlives_its_process():
    """What the judge does with an object of the program's, without a sandbox: ==, != and hashing raise (a set
    lookup would never reach __eq__), and a handle into a replaced process raises before any request."""
    from types import SimpleNamespace

    from scgrpo.verifiers.sandbox_harness import Remote

    worker = SimpleNamespace(generation=1)
    handle = Remote(worker, 0, "Stack", 1.0)
    for compare in (lambda: handle == 1, lambda: handle != 1, lambda: hash(handle), lambda: handle in {1, 2}):
        with pytest.raises(TypeError):
            compare()
    assert handle._handle() == 0
    worker.generation = 2
    with pytest.raises(RuntimeError, match="Stack object is gone"):
        handle._handle()


@pytest.mark.parametrize("mode", ["bwrap", "namespaces"])
def test_the_sandbox_starts_an_interpreter_that_lives_under_tmp(mode, tmp_path):
    """A venv under /tmp (where ``python3 -m venv /tmp/v`` puts it) is bound on top of the sandbox's own /tmp, not
    hidden by it: a program runs and scores from such an interpreter."""
    import site
    import subprocess
    import sys
    import venv

    from tests.verifiers.test_code_attacks import skip_unless

    skip_unless(mode)
    assert str(tmp_path).startswith("/tmp/") or pytest.skip("the test's folder is not under /tmp here")
    folder = tmp_path / "venv"
    venv.create(folder, with_pip=False)
    script = ("import sys\nfrom scgrpo.verifiers.sandbox import Sandbox\nbox = Sandbox(sys.argv[1])\n"
              "out = box.run('def f(x):\\n    return x + 1\\n', [{'type': 'call', 'fn': 'f', 'args': [1]}])\n"
              "print(box.mode, sys.prefix, out.results, out.failure)\n")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, *site.getsitepackages(), *sys.path[1:]]))
    done = subprocess.run([str(folder / "bin" / "python"), "-c", script, mode], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [mode, str(folder), "[{'value_json':", "'2'}]", "None"]


@pytest.mark.parametrize("required", [False, True])
def test_a_code_test_skips_with_the_reason_where_no_sandbox_starts_unless_one_is_required(required, monkeypatch,
                                                                                          request):
    """The suite's hook (tests/conftest.py, a wrapper around each test's call) on a test that met a sandbox that
    cannot start, its error raised as the sandbox raises it or behind another error (its cause, or raised while it was
    handled): a skip with the reason, unless SCGRPO_REQUIRE_SANDBOX is set, where the failure stands. Another error
    stands either way."""
    from scgrpo.verifiers.sandbox import SandboxError
    from tests import conftest

    class Outcome:
        def __init__(self, exception):
            self.exception, self.forced = exception, None

        def force_exception(self, exception):
            self.forced = exception

    def run(exception):
        hook = conftest.pytest_runtest_call(item=None)
        next(hook)
        outcome = Outcome(exception)
        with pytest.raises(StopIteration):
            hook.send(outcome)
        return outcome.forced

    monkeypatch.delenv("SCGRPO_REQUIRE_SANDBOX", raising=False)
    if required:
        monkeypatch.setenv("SCGRPO_REQUIRE_SANDBOX", "1")
    hooks = request.config.pluginmanager.hook.pytest_runtest_call.get_hookimpls()
    assert any(h.function is conftest.pytest_runtest_call and h.hookwrapper for h in hooks)
    direct = SandboxError("no sandbox works here: bwrap: not installed")
    try:
        raise RuntimeError("scoring failed") from direct  # (its __cause__ only)
    except RuntimeError as err:
        behind_cause = err
    try:
        try:
            raise SandboxError("no sandbox works here: bwrap: not installed")
        except SandboxError:
            raise RuntimeError("scoring failed")  # noqa: B904  (its __context__ only)
    except RuntimeError as err:
        behind_context = err
    for error in (direct, behind_cause, behind_context):
        forced = run(error)
        if required:
            assert forced is None
        else:
            assert isinstance(forced, pytest.skip.Exception), error
            assert str(forced) == "the code sandbox cannot start here: no sandbox works here: bwrap: not installed"
    assert run(SandboxError("the program's output is too long")) is None  # (a sandbox that started)
    assert run(ValueError("no sandbox works here")) is None  # (not the sandbox's error)
    assert run(None) is None
