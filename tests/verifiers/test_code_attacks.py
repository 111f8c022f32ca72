"""Programs that attack the code sandbox. Each must end with reward 0, leave no process running and nothing
written outside the sandbox, and leave this (the training) process unharmed.

All attacks of one isolation mode run as one parallel batch (a module fixture); each test checks one of them.
The modes run are those that work here: ``bwrap`` where bubblewrap is installed, ``namespaces`` where this runs
as root. Attacks that only namespaces stop are skipped for the ``process`` mode, which is exercised when
SCGRPO_SLOW_TESTS=1.
"""

import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest

from scgrpo.verifiers import PythonTests
from scgrpo.verifiers.sandbox import HARNESS, Sandbox, SandboxError

MARK = "The two processes inside the code sandbox"  # in every judge's and worker's command line
TOKEN = "hf_FAKEtokenForTheSandboxTest0123456789"
NEEDS_NAMESPACES = {"home_file", "network", "hidden_tests_on_disk", "write_tmp", "env_of_trainer"}


def _mode_works(mode):
    try:
        Sandbox(mode)
        return True
    except SandboxError as err:
        return str(err)


def _modes():
    params = []
    for mode in ("bwrap", "namespaces"):
        works = _mode_works(mode)
        reason = f"{mode} sandbox unavailable here: {works}"
        params.append(pytest.param(mode, marks=pytest.mark.skipif(works is not True, reason=reason)))
    slow = not os.environ.get("SCGRPO_SLOW_TESTS")
    params.append(pytest.param("process", marks=pytest.mark.skipif(slow, reason="set SCGRPO_SLOW_TESTS=1")))
    return params


def sandbox_processes():
    """Pids of live processes (zombies aside) whose command line is the sandbox harness."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARK.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _call(expected, fn="solve"):
    return [{"type": "call", "fn": fn, "args": [], "expected": expected}]


@pytest.fixture(scope="module", params=_modes())
def attacked(request, tmp_path_factory):
    """Runs every attack once in the mode; returns (mode, results by name, the places to check)."""
    mode = request.param
    run_dir = tmp_path_factory.mktemp("run")
    open_dir = tempfile.mkdtemp(prefix="scgrpo-attack-")  # world-readable, like a data folder or a home
    os.chmod(open_dir, 0o755)
    secret_file = os.path.join(open_dir, "secret.txt")
    with open(secret_file, "w") as f:
        f.write("home-secret")
    os.chmod(secret_file, 0o644)
    hidden = os.path.join(open_dir, "tests.jsonl")
    with open(hidden, "w") as f:
        f.write('{"expected": 987654321}\n')
    os.chmod(hidden, 0o644)
    stray_tmp = os.path.join(tempfile.gettempdir(), f"scgrpo-attack-stray-{os.getpid()}")
    home_target = os.path.join(os.path.expanduser("~"), f".scgrpo-attack-{os.getpid()}")

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port, connections, stop = server.getsockname()[1], [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            connections.append(1)
            conn.sendall(b"net-secret")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    old_token = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = TOKEN
    me = os.getpid()

    attacks = {
        "infinite_loop": ("while True:\n    pass\n", _call(1)),
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", _call(1)),
        "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n", _call(1)),
        "disk_fill": ("import os\ni = 0\nwhile True:\n    try:\n        open(f'f{i}', 'wb').write(os.urandom(1 << 20))\n"
                      "    except OSError:\n        pass\n    i += 1\n", _call(1)),
        "daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(0.5)\n"
                   f"        open({str(run_dir / 'daemon-was-here')!r}, 'w').write('x')\n        time.sleep(60)\n"
                   "    os._exit(0)\ndef solve():\n    return 0\n", _call(1)),
        # writes: what counts is that nothing appears on the host (test_nothing_left_running_nothing_written_outside)
        "write_run_folder": (f"open({str(run_dir / 'pwned')!r}, 'w').write('x')\n", _call(1)),
        "write_home": (f"open({home_target!r}, 'w').write('x')\n", _call(1)),
        "write_tmp": (f"open({stray_tmp!r}, 'w').write('x')\n", _call(1)),
        "env_secret": ("import os\ndef solve():\n    return os.environ.get('HF_TOKEN')\n", _call(TOKEN)),
        "env_of_trainer": (f"def solve():\n    data = open('/proc/{me}/environ', 'rb').read().split(b'\\0')\n"
                           "    return [v.split(b'=', 1)[1].decode() for v in data if v.startswith(b'HF_TOKEN=')][0]\n",
                           _call(TOKEN)),
        "home_file": (f"def solve():\n    return open({secret_file!r}).read()\n", _call("home-secret")),
        "network": (f"import socket\ndef solve():\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                    "    return s.recv(100).decode()\n", _call("net-secret")),
        "kill_parent": (f"import os, signal\nfor pid in (os.getppid(), {me}):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                        f"    except OSError:\n        pass\ntry:\n    os.killpg({os.getpgid(me)}, signal.SIGKILL)\n"
                        "except OSError:\n    pass\ndef solve():\n    return 0\n", _call(1)),
        "output_100mb": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
                         [{"type": "stdio", "input": "", "output": "3"}]),
        "sys_exit": ("import sys\nsys.exit(0)\n", _call(1)),
        "os_exit": ("import os\nos._exit(0)\n", _call(1)),
        "print_passed": ("import os, json, struct\nprint('ALL TESTS PASSED')\n"
                         "msg = json.dumps({'token': '0' * 32, 'results': [{'value': 1}]}).encode()\n"
                         "for fd in range(3, 64):\n    try:\n        os.write(fd, struct.pack('>I', len(msg)) + msg)\n"
                         "    except OSError:\n        pass\nos._exit(0)\n", _call(1)),
        "patch_assert": ("import builtins, unittest\nclass AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = object.__hash__\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
                         "unittest.TestCase.assertEqual = lambda *a, **k: None\ndef add(a, b):\n    return AlwaysEqual()\n",
                         [{"type": "assert", "code": "assert add(1, 2) == 3"}, {"type": "assert", "code": "assert add(2, 2) == 5"}]),
        "hidden_tests_on_disk": ("import json\ndef solve():\n"
                                 f"    return json.loads(open({hidden!r}).readline())['expected']\n", _call(987654321)),
    }
    verifier = PythonTests(isolation=mode, workers=2, timeout_s=4.0, test_timeout_s=1.0, cpu_s=1, memory_mb=256,
                           processes=16, file_mb=4, disk_mb=16, open_files=32, output_kb=64)
    names = list(attacks)
    start = time.monotonic()
    try:
        scored = verifier.verify_batch([f"```python\n{attacks[n][0]}```" for n in names],
                                       [attacks[n][1] for n in names], ["q"] * len(names))
        elapsed = time.monotonic() - start
        left_running = sandbox_processes()
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
        server.close()
        if old_token is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = old_token
    places = {"run_dir": run_dir, "stray_tmp": stray_tmp, "home_target": home_target}
    yield mode, dict(zip(names, scored)), places, left_running, connections, elapsed
    for path in (stray_tmp, home_target):
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(open_dir, ignore_errors=True)


ATTACKS = ["infinite_loop", "fork_bomb", "memory_bomb", "disk_fill", "daemon", "write_run_folder", "write_home",
           "write_tmp", "env_secret", "env_of_trainer", "home_file", "network", "kill_parent", "output_100mb",
           "sys_exit", "os_exit", "print_passed", "patch_assert", "hidden_tests_on_disk"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_gets_no_reward(attacked, attack):
    mode, results, *_ = attacked
    if mode == "process" and attack in NEEDS_NAMESPACES:
        pytest.skip(f"{attack}: only namespaces (bubblewrap or unshare) stop it")
    result = results[attack]
    assert not isinstance(result, Exception), result
    assert result.score == 0.0, (attack, result.info)


def test_nothing_left_running_nothing_written_outside(attacked):
    mode, results, places, left_running, connections, elapsed = attacked
    assert left_running == []
    time.sleep(0.7)  # past the daemon's sleep: had it survived, it would have written its file by now
    assert sorted(p.name for p in places["run_dir"].iterdir()) == []
    if mode != "process":
        assert not os.path.exists(places["stray_tmp"]) and not os.path.exists(places["home_target"])
        assert connections == []
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("scgrpo-sandbox-")]
    assert elapsed < 30


def test_the_attacks_fail_for_the_reason_expected(attacked):
    mode, results, *_ = attacked
    assert results["infinite_loop"].info["tests"] == ["timeout"]
    assert results["output_100mb"].info["tests"][0].startswith("error")
    assert results["sys_exit"].info["tests"][0].startswith("error: SystemExit")
    assert results["patch_assert"].info["tests"] == ["wrong", "wrong"]
    if mode != "process":
        assert results["network"].info["tests"][0].startswith("error: ")


def test_the_harness_file_is_standard_library_only():
    import ast

    tree = ast.parse(open(HARNESS).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "scgrpo" not in imported and imported <= {"ctypes", "json", "os", "select", "signal", "struct", "sys", "time",
                                                      "resource", "subprocess", "io"}
    assert stat.S_ISREG(os.stat(HARNESS).st_mode)
