"""CodeTask's problems and held-out tests, and FileSource rows with a tests column."""

import json

from scgrpo.data import CodeTask, FileSource, resolve_source
from scgrpo.data.code import FAMILIES
from scgrpo.verifiers import NumericVerifier, PythonTests


def test_code_task_splits_hold_out_problems_and_tests():
    task = CodeTask(num_train=40, num_test=10, tests_per_problem=6, seed=3)
    train, test = task.rows("train"), task.rows("test")
    assert len(train) == 40 and len(test) == 10
    names = lambda rows: {r["answer"]["tests"][0]["fn"] for r in rows}  # noqa: E731
    assert not names(train) & names(test)  # test problems are not trained on
    for row in train + test:
        tests = row["answer"]["tests"]
        assert len(tests) == 3 and all(t["type"] == "call" for t in tests)
        assert tests[0]["fn"] in row["question"] and "```python" in row["question"]
        calls = [f"`{t['fn']}({', '.join(map(repr, t['args']))})`" for t in tests]
        assert not any(call in row["question"] for call in calls)  # the example is not a reward test
    assert CodeTask(num_train=40, num_test=10, seed=3).rows("train")[5] == CodeTask(num_train=40, num_test=10, seed=3).rows("train")[5]
    assert isinstance(resolve_source("code"), CodeTask) and isinstance(task.default_verifier(), PythonTests)


SOLUTIONS = {  # written from the problem statements, not from the reference code
    "scale": "def {fn}(x):\n    k, c = {nums}\n    return x * k + c\n",
    "drop": "def {fn}(s):\n    return ''.join(ch for ch in s if ch != '{last}')\n",
    "count_above": "def {fn}(xs):\n    return len([x for x in xs if x > {num}])\n",
}


def test_solutions_written_from_the_statements_pass_and_wrong_ones_do_not():
    import re

    rows = CodeTask(num_train=200, num_test=0, seed=0).rows("train")
    programs, answers = [], []
    for prefix, template in SOLUTIONS.items():
        row = next(r for r in rows if r["answer"]["tests"][0]["fn"].startswith(prefix))
        fn = row["answer"]["tests"][0]["fn"]
        nums = [int(n.replace("m", "-")) for n in re.findall(r"m?\d+", fn)]
        code = template.format(fn=fn, nums=tuple(nums), num=nums[0] if nums else 0, last=fn.rsplit("_", 1)[1])
        programs += [f"```python\n{code}```", f"```python\ndef {fn}(*args):\n    return None\n```"]
        answers += [row["answer"]] * 2
    scores = [r.score for r in PythonTests(test_timeout_s=1.0).verify_batch(programs, answers, ["q"] * len(programs))]
    assert scores == [1.0, 0.0] * len(SOLUTIONS)


def test_file_source_reads_a_tests_column_and_picks_the_code_verifier(tmp_path):
    rows = [
        {"prompt": "Write add(a, b).", "tests": json.dumps(["assert add(1, 2) == 3"])},
        {"prompt": "Read two numbers, print their sum.", "tests": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}])},
        {"prompt": "no tests here", "tests": None},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    source = FileSource(str(path), columns={"question": "prompt"})
    loaded = source.rows("train")
    assert len(loaded) == 2  # the row without tests is skipped and counted
    verifier = source.default_verifier()
    assert isinstance(verifier, PythonTests)
    answers = [loaded[0]["answer"], loaded[1]["answer"]]
    code = ["```python\ndef add(a, b):\n    return a + b\n```", "```python\nprint(sum(map(int, input().split())))\n```"]
    assert [r.score for r in verifier.verify_batch(code, answers, ["q", "q"])] == [1.0, 1.0]


def test_file_source_finds_mbpp_and_humaneval_test_columns_and_decides_by_the_train_split(tmp_path):
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
                                "test_setup_code": "import math"}) + "\n")
    humaneval = tmp_path / "humaneval.jsonl"
    humaneval.write_text(json.dumps({"prompt": "def add(a, b):", "entry_point": "add",
                                     "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}) + "\n")
    numeric = tmp_path / "numeric.jsonl"
    numeric.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}) + "\n")
    by_name = FileSource(str(mbpp), columns={"question": "text", "answer": "test_list"})
    found = FileSource({"train": str(humaneval), "test": str(numeric)}, columns={"question": "prompt"})
    found.rows("test")  # read last, yet the train split decides
    assert isinstance(by_name.default_verifier(), PythonTests) and isinstance(found.default_verifier(), PythonTests)
    assert isinstance(FileSource(str(numeric), columns={"question": "prompt"}).default_verifier(), NumericVerifier)
    answers = [by_name.rows("train")[0]["answer"], found.rows("train")[0]["answer"]]
    assert answers[0]["test_setup_code"] == "import math" and answers[1]["entry_point"] == "add"
    add = "```python\ndef add(a, b):\n    return a + b\n```"
    assert [r.score for r in PythonTests(test_timeout_s=1.0).verify_batch([add, add], answers, ["q", "q"])] == [1.0, 1.0]
