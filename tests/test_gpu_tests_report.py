"""scripts/gpu_tests_report.py: the GPU test page from a JUnit file pytest wrote, a row per test with its outcome."""

import subprocess
import sys

from tests.helpers import load_script

report = load_script("gpu_tests_report")

SAMPLE = '''import pytest

def test_fine():
    assert 1 + 1 == 2

@pytest.mark.parametrize("x", [1, 2])
def test_close(x):
    assert abs(x * 1e-3) < 1.5e-3, f"differs by {x * 1e-3}"

@pytest.mark.skip(reason="needs a GPU")
def test_on_a_card():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("no driver")

def test_setup_fails(broken):
    pass
'''


def test_the_page_has_a_row_per_test_with_its_outcome_and_reason(tmp_path):
    folder = tmp_path / "tests" / "gpu"
    folder.mkdir(parents=True)
    (folder / "test_sample.py").write_text(SAMPLE)
    junit = tmp_path / "run.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    "--rootdir", str(tmp_path), "tests/gpu/test_sample.py"], cwd=tmp_path, capture_output=True)
    cases = {c.name: c for c in report.read_junit(str(junit))}
    assert {name: c.outcome for name, c in cases.items()} == {
        "gpu/test_sample.py::test_fine": "passed", "gpu/test_sample.py::test_close[1]": "passed",
        "gpu/test_sample.py::test_close[2]": "failed", "gpu/test_sample.py::test_on_a_card": "skipped",
        "gpu/test_sample.py::test_setup_fails": "error"}
    assert "differs by 0.002" in cases["gpu/test_sample.py::test_close[2]"].note
    assert cases["gpu/test_sample.py::test_on_a_card"].note == "needs a GPU"
    assert "no driver" in cases["gpu/test_sample.py::test_setup_fails"].note

    out = tmp_path / "gpu_tests.md"
    assert report.main([str(junit), "--out", str(out), "--card", "NVIDIA H200", "--versions", "torch 2.11",
                        "--commit", "abc1234"]) == 0
    text = out.read_text()
    assert "Last run: **NVIDIA H200, " in text and "at commit abc1234; torch 2.11." in text
    assert "That run: 2 passed, 1 failed, 1 error, 1 skipped." in text
    assert "| `gpu/test_sample.py::test_close[2]` | **failed** | " in text
    assert "| `gpu/test_sample.py::test_fine` | passed |  |" in text
    assert text.count("\n| `") == 5


def test_an_empty_junit_file_writes_no_page(tmp_path):
    junit = tmp_path / "empty.xml"
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    assert report.main([str(junit), "--out", str(tmp_path / "page.md")]) == 1
    assert not (tmp_path / "page.md").exists()


def test_the_commit_named_by_the_environment_wins(monkeypatch):
    monkeypatch.setenv("SCGRPO_COMMIT", "abc1234")
    assert report.commit() == "abc1234"
    monkeypatch.delenv("SCGRPO_COMMIT")
    assert report.commit() != "abc1234" and report.commit()
