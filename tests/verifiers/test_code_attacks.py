"""Programs that attack the code sandbox. Each must end with reward 0, leave no process running and nothing
written outside the sandbox, and leave this (the training) process unharmed.

Every attack program first attacks, then defines the right answer: were the attack not stopped, it would score
1 (the controls, right answers alone, do score 1). All programs of one isolation mode run as one parallel batch
(a module fixture); each test checks one of them. The modes run are those that work here: ``bwrap`` where
bubblewrap is installed, ``namespaces`` where this runs as root. The ``process`` mode, run with
SCGRPO_SLOW_TESTS=1, skips the attacks that only namespaces (or a uid of its own) stop.
"""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from scgrpo.verifiers import PythonTests
from scgrpo.verifiers.sandbox import HARNESS, UID_BASE, UID_SPAN
from tests.verifiers import modes
from tests.verifiers.servers import answering

MARK = "The two processes inside the code sandbox"  # in every judge's and worker's command line
TOKEN = "hf_FAKEtokenForTheSandboxTest0123456789"
NEEDS_NAMESPACES = {"home_file", "network", "hidden_tests_on_disk", "write_tmp", "write_home", "write_run_folder",
                    "kill_parent", "fork_bomb", "disk_fill", "daemon"}
SOLVE = "def solve():\n    return 1\n"
# the test expects add('x', 1) to raise: it must not take the judge's own timeout for the program's exception
EXPECTS_RAISE = ["try:\n    add('x', 1)\n    ok = False\nexcept Exception:\n    ok = True\nassert ok",
                 "try:\n    add('x', 1)\n    ok = False\nexcept:\n    ok = True\nassert ok"]

# MBPP task 2 and HumanEval/2, verbatim tests: a program that redefines a builtin the tests use must not pass
MBPP_2 = ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
          "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
          "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))"]
HUMANEVAL_2 = {"test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\ndef check(candidate):\n"
                       "    assert candidate(3.5) == 0.5\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
                       "    assert abs(candidate(123.456) - 0.456) < 1e-6\n",
               "entry_point": "truncate_number"}
# a function named like a builtin is what these test: the builtin must not stand in for a program without it
MAX_MBPP = ["assert max([1, 5, 2]) == 5", "assert max([0]) == 0"]
MAX_HUMANEVAL = {"test": "def check(candidate):\n    assert candidate([1, 5, 2]) == 5\n", "entry_point": "max"}
# no entry point: the tests hand check() the builtin name
MAX_CHECK = "def check(candidate):\n    assert candidate([1, 5, 2]) == 5\n\ncheck(max)\n"
# entry point given, but the tests reach it as a method: the class is what the program must define
SOLUTION_ADD = {"tests": ["assert Solution().add(1, 2) == 3"], "entry_point": "add"}
# objects of the program's classes stay in its process; the tests read and call them through handles
STACK = ["s = Stack()\ns.push(1)\ns.push([2])\nassert s.pop() == [2] and s.size == 1 and s.top == 1",
         "assert Stack().push(1) is None and Stack().size == 0", "s = Stack()\nassert not s\ns.push(0)\nassert s"]
# an object returned where a truth value is tested: its own truth value counts (false here), not the handle's
TRUTHY = ["assert is_even(2)", "assert is_even(4)"]
# objects handed back to the program (MBPP 601), and what a test may ask of an object
PAIRS = ["assert max_chain_length([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3"]
PAIRS_PROGRAM = ("class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
                 "def max_chain_length(pairs, n):\n    end, count = None, 0\n"
                 "    for p in sorted(pairs, key=lambda p: p.b):\n        if end is None or p.a > end:\n"
                 "            end, count = p.b, count + 1\n    return count\n")
BAG = ["b = Bag([3, 1])\nassert len(b) == 2 and sorted(b) == [1, 3] and 3 in b and 4 not in b and b[0] == 3",
       "assert str(Bag([1])) == 'Bag(1)' and list(evens(5)) == [0, 2, 4]",
       "a = Bag([])\na.total = 5\nassert a.total == 5 and a.size() == 0"]
BAG_PROGRAM = ("class Bag:\n    def __init__(self, items):\n        self.items = items\n"
               "    def __len__(self):\n        return len(self.items)\n    def __iter__(self):\n        return iter(self.items)\n"
               "    def __getitem__(self, i):\n        return self.items[i]\n"
               "    def __str__(self):\n        return f'Bag({len(self.items)})'\n"
               "    def size(self):\n        return len(self.items)\n"
               "def evens(n):\n    return (i for i in range(n) if i % 2 == 0)\n")
# an iterator read lazily (an endless one too), and membership compared in the judge, not by __contains__
GEN = {"tests": ["assert list(islice(fib(), 5)) == [0, 1, 1, 2, 3]", "g = fib()\nassert next(g) == 0 and next(g) == 1",
                 "assert 2 in evens(4) and 3 not in evens(4)"], "setup": "from itertools import islice"}
GEN_PROGRAM = ("def fib():\n    a, b = 0, 1\n    while True:\n        yield a\n        a, b = b, a + b\n"
               "def evens(n):\n    return (i for i in range(n) if i % 2 == 0)\n")
PREFIXES = {"test": "def check(candidate):\n    assert 'ab' in candidate('abc')\n    assert 'abc' in candidate('abc')\n",
            "entry_point": "all_prefixes"}
# a test that times out replaces the process: the tests' namespace (and the handles in it) are made again
HANG = ["s = Stack()\ns.push(1)\nassert s.pop() == 1", "assert hang() == 1", "assert 's' not in globals()"]
# a test's handle not kept: each test starts in a fresh process with its own CPU budget
SQUARES = [f"assert Solution().sq({i}) == {i * i}" for i in range(4)]
# a stack pushed in the set-up, popped after a test that keeps the CPU busy: the process (and the stack) stay
STACK_BUSY = ("s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert burn(0.3) == 0.3\n"
              "assert s.pop() == 1\n")


def mode_unavailable(mode):
    """Why ``mode`` does not work here, or is not run (None when it runs)."""
    if mode == "process" and not os.environ.get("SCGRPO_SLOW_TESTS"):
        return "set SCGRPO_SLOW_TESTS=1"
    return modes.mode_unavailable(mode)


def skip_unless(mode):
    if mode == "process" and not os.environ.get("SCGRPO_SLOW_TESTS"):
        pytest.skip("set SCGRPO_SLOW_TESTS=1")
    modes.skip_unless(mode)


def _descends_from_here(pid):
    me = os.getpid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # (the parent's pid)
        except (OSError, ValueError, IndexError):
            return False
        if pid == me:
            return True
    return False


def sandbox_processes(before=(), uids=None):
    """Live processes (zombies aside, and those in ``before``) that belong to a sandbox: run under a sandbox
    uid (whatever binary they became) or with the harness on their command line. With ``uids``, only this
    process's sandboxes: those uids, or a harness this process started (another process's sandboxes on the
    machine are not this test's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in before:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ids = [int(u) for u in status["Uid"].split()]
        if uids is None:
            ours = any(UID_BASE <= u < UID_BASE + UID_SPAN for u in ids) or MARK.encode() in cmdline
        else:
            ours = any(u in uids for u in ids) or (MARK.encode() in cmdline and _descends_from_here(int(pid)))
        if ours and not status["State"].strip().startswith("Z"):
            found.append((int(pid), cmdline[:80]))
    return found


def _call(expected, fn="solve"):
    return [{"type": "call", "fn": fn, "args": [], "expected": expected}]


@pytest.fixture(scope="module", params=["bwrap", "namespaces", "process"])
def attacked(request, tmp_path_factory):
    """Runs every attack and control once in the mode; returns what the tests check."""
    mode = request.param
    skip_unless(mode)
    run_dir = tmp_path_factory.mktemp("run")
    home = tempfile.mkdtemp(prefix="scgrpo-attack-home-")  # this process's $HOME for the batch
    os.chmod(home, 0o755)  # readable by all, like a home or a data folder
    secret_file = os.path.join(home, "secret.txt")
    with open(secret_file, "w") as f:
        f.write("home-secret")
    hidden = os.path.join(home, "tests.jsonl")
    with open(hidden, "w") as f:
        f.write('{"expected": 987654321}\n')
    for path in (secret_file, hidden):
        os.chmod(path, 0o644)
    stray_tmp = os.path.join(tempfile.gettempdir(), f"scgrpo-attack-stray-{os.getpid()}")
    home_target = os.path.join(home, ".written-by-the-program")
    daemon_mark = str(run_dir / "daemon-was-here")

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port, listener = server.getsockname()[1], answering(server, b"net-secret")
    connections = listener.__enter__()  # (left in the finally below)
    saved = {k: os.environ.get(k) for k in ("HF_TOKEN", "HOME")}
    os.environ.update(HF_TOKEN=TOKEN, HOME=home)
    me = os.getpid()

    attacks = {  # name: (program, tests); the attack comes first, then the right answer
        "infinite_loop": ("while True:\n    pass\n" + SOLVE, _call(1)),
        "fork_bomb": ("import os, time\nfor _ in range(200):\n    if os.fork() == 0:\n        time.sleep(30)\n"
                      "        os._exit(0)\n" + SOLVE, _call(1)),
        "memory_bomb": ("chunk = bytearray(2 << 30)\n" + SOLVE, _call(1)),
        "disk_fill": ("import os\nfor i in range(40):\n    with open(f'f{i}', 'wb') as f:\n"
                      "        f.write(b'x' * (1 << 20))\n" + SOLVE, _call(1)),
        # a daemon that tries to leave the session (refused where the sandbox's seccomp filters stand) and becomes
        # another binary; were it alive after the run it would write its mark (checked later) and be seen by its uid
        "daemon": ("import os, time\nif os.fork() == 0:\n    try:\n        os.setsid()\n    except OSError:\n        pass\n"
                   "    if os.fork() == 0:\n        time.sleep(0.5)\n"
                   f"        open({daemon_mark!r}, 'w').write('x')\n        os.execv('/bin/sleep', ['sleep', '30'])\n"
                   "    os._exit(0)\ntime.sleep(1.5)\n" + SOLVE, _call(1)),
        "write_run_folder": (f"open({str(run_dir / 'pwned')!r}, 'w').write('x')\n" + SOLVE, _call(1)),
        "write_home": (f"open({home_target!r}, 'w').write('x')\n" + SOLVE, _call(1)),
        # lands in the sandbox's own /tmp, so the program may well pass: what counts is that the host's /tmp
        # holds nothing (test_nothing_left_running_nothing_written_outside)
        "write_tmp": (f"open({stray_tmp!r}, 'w').write('x')\n" + SOLVE, _call(1)),
        "env_secret": ("import os\ndef solve():\n    return os.environ.get('HF_TOKEN')\n", _call(TOKEN)),
        "env_of_trainer": (f"def solve():\n    data = open('/proc/{me}/environ', 'rb').read().split(b'\\0')\n"
                           "    return [v.split(b'=', 1)[1].decode() for v in data if v.startswith(b'HF_TOKEN=')][0]\n",
                           _call(TOKEN)),
        "home_file": (f"def solve():\n    return open({secret_file!r}).read()\n", _call("home-secret")),
        "network": (f"import socket\ndef solve():\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                    "    return s.recv(100).decode()\n", _call("net-secret")),
        "kill_parent": (f"import os, signal\nos.kill({me}, signal.SIGKILL)\nos.killpg({os.getpgid(me)}, signal.SIGKILL)\n"
                        "os.kill(os.getppid(), signal.SIGKILL)\n" + SOLVE, _call(1)),
        # a user namespace of its own: there it could mount a tmpfs and fill memory no resource limit counts (the
        # reward only where unshare succeeds)
        "user_namespace": ("import ctypes\ndef solve():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
                           "    return 1 if libc.unshare(0x10000000) == 0 else 0\n", _call(1)),
        # the same through a 32-bit call (int 0x80: i386's unshare is 310), which a filter of x86_64's numbers
        # alone would let through (no reward elsewhere than on x86_64)
        "user_namespace_32bit": ("import ctypes, mmap, os, struct\ndef solve():\n    if os.uname().machine != 'x86_64':\n"
                                 "        return 0\n    code = (b'\\x53\\xb8' + struct.pack('<I', 310) + b'\\xbb'"
                                 " + struct.pack('<I', 0x10000000) + b'\\xcd\\x80\\x5b\\xc3')\n"
                                 "    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
                                 "    m.write(code)\n    call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n"
                                 "    return 1 if call() == 0 else 0\n", _call(1)),
        # memory outside the address-space limit: a 64 MiB SysV segment; 16 memory files of 3 MiB (each under the
        # file-size limit: together up to open_files x file_mb)
        "sysv_shm": ("import ctypes\ndef solve():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
                     "    libc.shmat.restype = ctypes.c_void_p\n"
                     "    shm = libc.shmget(0, 64 << 20, 0o1600)\n    if shm < 0:\n        return 0\n"
                     "    at = libc.shmat(shm, None, 0)\n    if at in (None, ctypes.c_void_p(-1).value):\n        return 0\n"
                     "    ctypes.memset(at, 1, 64 << 20)\n    return 1\n", _call(1)),
        "memfd": ("import os\nheld = []\ndef solve():\n    try:\n        for _ in range(16):\n"
                  "            held.append(os.memfd_create('m'))\n            for _ in range(3):\n"
                  "                os.write(held[-1], b'x' * (1 << 20))\n    except OSError:\n        return 0\n"
                  "    return 1\n", _call(1)),
        # kernel memory no process's count includes: data queued in socket pairs with enlarged buffers (28 pairs of
        # 8 MiB buffers queued 437 MiB in one process)
        "socket_buffers": ("import socket\ndef solve():\n    a, b = socket.socketpair()\n    for option in (7, 8, 32, 33):\n"
                           "        try:\n            a.setsockopt(socket.SOL_SOCKET, option, 64 << 20)\n"
                           "            return 1\n        except OSError:\n            pass\n    return 0\n", _call(1)),
        "output_100mb": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\nprint(3)\n",
                         [{"type": "stdio", "input": "", "output": "3"}]),
        "sys_exit": (SOLVE + "import sys\nsys.exit(0)\n", _call(1)),
        "os_exit": (SOLVE + "import os\nos._exit(0)\n", _call(1)),
        "print_passed": (SOLVE + "import os, json, struct\nprint('ALL TESTS PASSED')\n"
                         "msg = json.dumps({'token': '0' * 32, 'results': [{'value': 1}]}).encode()\n"
                         "for fd in range(3, 64):\n    try:\n        os.write(fd, struct.pack('>I', len(msg)) + msg)\n"
                         "    except OSError:\n        pass\nos._exit(0)\n", _call(1)),
        "patch_assert": ("import builtins, unittest\nclass AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = object.__hash__\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
                         "unittest.TestCase.assertEqual = lambda *a, **k: None\ndef add(a, b):\n    return AlwaysEqual()\n",
                         [{"type": "assert", "code": "assert add(1, 2) == 3"}, {"type": "assert", "code": "assert add(2, 2) == 5"}]),
        "shadow_set": ("def set(*args):\n    return 0\ndef similar_elements(a, b):\n    return None\n", MBPP_2),
        "shadow_abs": ("def abs(x):\n    return 0\ndef truncate_number(number):\n    return 0.5\n", HUMANEVAL_2),
        "builtin_named_missing": ("pass\n", MAX_MBPP),
        "builtin_named_missing_check": ("pass\n", MAX_HUMANEVAL),
        "builtin_named_wrong": ("def max(xs):\n    return 0\n", MAX_HUMANEVAL),
        "builtin_handed_missing": ("pass\n", MAX_CHECK),
        "builtin_alias": ("import builtins\nmax = builtins.max\n", MAX_MBPP),
        "builtin_alias_check": ("from builtins import max\n", MAX_CHECK),
        "contains_always": ("class A:\n    def __contains__(self, x):\n        return True\n"
                            "def all_prefixes(s):\n    return A()\n", PREFIXES),
        "hashed_not_in": ("class T:\n    pass\ndef f(x):\n    return T()\n", ["assert f(3) not in {0, 1}"]),
        "object_not_equal": ("class T:\n    pass\ndef f(x):\n    return T()\n", ["assert f(0) != 0", "assert f(1) != f(1)"]),
        "object_for_truth": ("class Thing:\n    def __bool__(self):\n        return False\ndef is_even(n):\n    return Thing()\n", TRUTHY),
        "swallowed_timeout": ("def add(a, b):\n    while True:\n        pass\n", EXPECTS_RAISE),
        # SIGALRM to the judge (its parent, of the same uid) while it waits for the answer
        "alarm_the_judge": ("import os, signal, time\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGALRM)\n"
                            "    time.sleep(0.1)\n    return 0\n", EXPECTS_RAISE),
        "hidden_tests_on_disk": ("import json\ndef solve():\n"
                                 f"    return json.loads(open({hidden!r}).readline())['expected']\n", _call(987654321)),
    }
    controls = {  # right answers alone: these score 1, so the attacks' 0 is the defence's doing
        "solve": (SOLVE, _call(1)),
        "mbpp_2": ("def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n", MBPP_2),
        "humaneval_2": ("def truncate_number(number):\n    return number % 1.0\n", HUMANEVAL_2),
        "max_mbpp": ("def max(xs):\n    return sorted(xs)[-1]\n", MAX_MBPP),
        "raises_type_error": ("def add(a, b):\n    return a + b\n",
                              [EXPECTS_RAISE[0].replace("except Exception", "except TypeError"), "assert add(1, 2) == 3"]),
        "max_humaneval": ("def max(xs):\n    return sorted(xs)[-1]\n", MAX_HUMANEVAL),
        "max_check": ("def max(xs):\n    return sorted(xs)[-1]\n", MAX_CHECK),
        "generators": (GEN_PROGRAM, GEN),
        "prefixes": ("def all_prefixes(s):\n    return [s[:i] for i in range(1, len(s) + 1)]\n", PREFIXES),
        "namespace_after_timeout": ("import time\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
                                    "    def push(self, x):\n        self.items.append(x)\n"
                                    "    def pop(self):\n        return self.items.pop()\n"
                                    "def hang():\n    time.sleep(30)\n", HANG),
        "squares_cpu": ("import time\nclass Solution:\n    def sq(self, x):\n        t = time.process_time()\n"
                        "        while time.process_time() - t < 0.35:\n            pass\n        return x * x\n", SQUARES),
        # socket pairs themselves still work (multiprocessing's duplex pipes are socket pairs), at the default size
        # (socket() is refused; a socket pair and its other options still work)
        "socket_pair": ("import socket\ndef solve():\n    a, b = socket.socketpair()\n    a.sendall(b'x' * 1000)\n"
                        "    a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                        "    b.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)\n"
                        "    return len(b.recv(2000))\n", _call(1000)),
        "map_square": ("def square(x):\n    return x * x\n", ["assert list(map(square, [1, 2])) == [1, 4]"]),
        "pairs": (PAIRS_PROGRAM, PAIRS),
        "bag": (BAG_PROGRAM, BAG),
        "stack_busy": ("import time\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
                       "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
                       "def burn(s):\n    t = time.process_time()\n    while time.process_time() - t < s:\n        pass\n"
                       "    return s\n", STACK_BUSY),
        "solution_add": ("class Solution:\n    def add(self, a, b):\n        return a + b\n", SOLUTION_ADD),
        # a correct program that sends SIGINT to its parent, the judge, in each call: the judge ignores it (with
        # Python's handler it would raise KeyboardInterrupt in the middle of a test and lose the results)
        "signals_the_judge": ("import os, signal\ndef f(x):\n    os.kill(os.getppid(), signal.SIGINT)\n    return x\n",
                              [{"type": "call", "fn": "f", "args": [i], "expected": i} for i in range(2)]),
        # ... while the program itself keeps Python's SIGINT handling (the judge's ignoring is not inherited)
        "own_keyboard_interrupt": ("import os, signal, time\ndef f(x):\n    try:\n        os.kill(os.getpid(), signal.SIGINT)\n"
                                   "        time.sleep(0.2)\n    except KeyboardInterrupt:\n        return x\n    return -1\n",
                                   [{"type": "call", "fn": "f", "args": [3], "expected": 3}]),
        "stack_class": ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
                        "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
                        "    @property\n    def size(self):\n        return len(self.items)\n"
                        "    @property\n    def top(self):\n        return self.items[-1]\n"
                        "    def __len__(self):\n        return len(self.items)\n", STACK),
        # a test that hangs, then one that passes: the program is restarted (and its pid namespace survives)
        "hang_then_pass": ("import time\ndef f(x):\n    if x == 1:\n        time.sleep(30)\n    return x\n",
                           [{"type": "call", "fn": "f", "args": [1], "expected": 1},
                            {"type": "call", "fn": "f", "args": [2], "expected": 2}]),
        # 0.35 s of CPU time a test with a 1 s CPU limit: each test gets its own budget
        "cpu_each_test": ("import time\ndef f(x):\n    t = time.process_time()\n    while time.process_time() - t < 0.35:\n"
                          "        pass\n    return x\n", [{"type": "call", "fn": "f", "args": [i], "expected": i} for i in range(3)]),
        # 0.4 s a test, 12 tests, a 4 s program limit: the tests reached count, the rest are timeouts
        "past_the_program_limit": ("import time\ndef f(x):\n    time.sleep(0.4)\n    return x\n",
                                   [{"type": "call", "fn": "f", "args": [i], "expected": i} for i in range(12)]),
    }
    programs = {**attacks, **controls}
    verifier = PythonTests(isolation=mode, workers=2, timeout_s=4.0, test_timeout_s=1.0, cpu_s=1, memory_mb=256,
                           processes=16, file_mb=4, disk_mb=16, open_files=32, output_kb=64)
    names = list(programs)
    before = {pid for pid, _ in sandbox_processes()}
    folders_before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("scgrpo-sandbox-")}  # (others')
    run, walls, issued = verifier.sandbox.run, [], set()
    new_uid = verifier.sandbox._new_uid

    def recorded_uid():  # (the uids this batch's programs ran as)
        uid = new_uid()
        issued.add(uid)
        return uid

    verifier.sandbox._new_uid = recorded_uid

    def timed(*args, **kwargs):  # each program's wall time, from the host's call to its verdict
        start = time.monotonic()
        try:
            return run(*args, **kwargs)
        finally:
            walls.append(time.monotonic() - start)

    verifier.sandbox.run = timed
    try:
        scored = verifier.verify_batch([f"```python\n{programs[n][0]}```" for n in names],
                                       [programs[n][1] for n in names], ["q"] * len(names))
        elapsed = max(walls)
        left_running = sandbox_processes(before, issued)
    finally:
        listener.__exit__(None, None, None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    places = {"run_dir": run_dir, "stray_tmp": stray_tmp, "home": home, "home_target": home_target,
              "home_files": sorted(os.listdir(home)), "folders_before": folders_before}
    yield mode, dict(zip(names, scored)), places, left_running, connections, elapsed
    if os.path.exists(stray_tmp):
        os.remove(stray_tmp)
    shutil.rmtree(home, ignore_errors=True)


ATTACKS = ["infinite_loop", "fork_bomb", "memory_bomb", "disk_fill", "daemon", "write_run_folder", "write_home",
           "env_secret", "env_of_trainer", "home_file", "network", "kill_parent", "output_100mb",
           "sys_exit", "os_exit", "print_passed", "patch_assert", "shadow_set", "shadow_abs", "builtin_named_missing", "builtin_named_missing_check", "builtin_named_wrong",
           "builtin_handed_missing", "builtin_alias", "builtin_alias_check", "object_for_truth", "object_not_equal",
           "contains_always", "hashed_not_in",
           "swallowed_timeout", "alarm_the_judge", "hidden_tests_on_disk", "user_namespace", "user_namespace_32bit",
           "sysv_shm", "memfd", "socket_buffers"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_gets_no_reward(attacked, attack):
    mode, results, *_ = attacked
    if mode == "process" and attack in NEEDS_NAMESPACES:
        pytest.skip(f"{attack}: only namespaces (bubblewrap or unshare) stop it")
    result = results[attack]
    assert not isinstance(result, Exception), result
    assert result.score == 0.0, (attack, result.info)


def test_right_answers_alone_score_and_are_scored_test_by_test(attacked):
    mode, results, *_ = attacked
    for name in ("solve", "mbpp_2", "humaneval_2", "max_mbpp", "max_humaneval", "max_check", "solution_add",
                 "stack_class", "map_square", "pairs", "bag", "stack_busy",
                 "generators", "prefixes", "squares_cpu",
                 "raises_type_error", "cpu_each_test", "signals_the_judge", "own_keyboard_interrupt", "socket_pair"):
        assert results[name].score == 1.0, (name, results[name].info)
    assert results["hang_then_pass"].info["tests"] == ["timeout", "pass"]
    assert results["namespace_after_timeout"].info["tests"] == ["pass", "timeout", "pass"]
    reached = results["past_the_program_limit"].info["tests"]
    passed = reached.count("pass")
    assert 1 <= passed < 12 and reached == ["pass"] * passed + ["timeout"] * (12 - passed), reached


def test_nothing_left_running_nothing_written_outside(attacked):
    mode, results, places, left_running, connections, elapsed = attacked
    assert left_running == []
    time.sleep(0.7)  # past the daemon's sleep: had it survived, it would have written its mark by now
    assert sorted(p.name for p in places["run_dir"].iterdir()) == []
    assert places["home_files"] == ["secret.txt", "tests.jsonl"]
    if mode != "process":
        assert results["write_tmp"].score == 1.0 and not os.path.exists(places["stray_tmp"])  # its own /tmp
        assert connections == []
    assert not [n for n in os.listdir(tempfile.gettempdir())
                if n.startswith("scgrpo-sandbox-") and n not in places["folders_before"]]
    # the slowest program, from the host's call to its verdict: its 4 s deadline, and up to as long again for
    # starting and ending its sandbox on a loaded machine (a program that outlived the deadline would take its own
    # sleep, 30 s or more, or forever)
    assert elapsed < 2 * 4.0, elapsed


def test_the_attacks_fail_for_the_reason_expected(attacked):
    mode, results, *_ = attacked
    outcome = lambda name: results[name].info["tests"][0]  # noqa: E731
    assert outcome("infinite_loop") in ("timeout", "error: CPU time limit (1 s) exceeded")
    assert "MemoryError" in outcome("memory_bomb")
    assert outcome("output_100mb").startswith("error")
    assert outcome("sys_exit").startswith("error: SystemExit")
    assert results["patch_assert"].info["tests"] == [
        "error: TypeError: <the program's AlwaysEqual object> is not plain data: it cannot be compared"] * 2
    # the builtin set, not the program's, meets similar_elements' None
    assert results["shadow_set"].info["tests"] == ["error: TypeError: 'NoneType' object is not iterable"] * 3
    assert results["shadow_abs"].info["tests"] == ["wrong"]
    assert results["builtin_named_missing"].info["tests"] == ["error: NameError: the program defines no 'max'"] * 2
    assert results["builtin_named_missing_check"].info["tests"] == ["error: NameError: the program defines no 'max'"]
    assert results["builtin_named_wrong"].info["tests"] == ["wrong"]
    assert results["builtin_handed_missing"].info["tests"] == ["error: NameError: the program defines no 'max'"]
    assert results["builtin_alias"].info["tests"] == ["error: NameError: the program defines no 'max'"] * 2
    assert all(o.startswith("error: TypeError: <the program's T object> is not plain data")
               for o in results["object_not_equal"].info["tests"])
    # the judge's timeout (or the CPU limit, or a killed worker on a loaded machine), never the test's own verdict
    assert all(o == "timeout" or o.startswith("error: ") for o in results["swallowed_timeout"].info["tests"])
    assert results["alarm_the_judge"].info["tests"] == ["wrong"] * 2
    if mode != "process":
        assert outcome("network").startswith("error: ")
        assert "BlockingIOError" in outcome("fork_bomb")  # the process limit, reached
        assert "No space left on device" in outcome("disk_fill")  # the sized /tmp, full
        assert "ProcessLookupError" in outcome("kill_parent")  # the trainer is not even visible


def test_the_harness_file_is_standard_library_only():
    import ast

    tree = ast.parse(open(HARNESS).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "scgrpo" not in imported and imported <= {"ast", "builtins", "ctypes", "json", "os", "select", "signal",
                                                      "struct", "sys", "time", "resource", "subprocess", "io", "threading"}
    assert stat.S_ISREG(os.stat(HARNESS).st_mode)


READ_ONLY_SUBMOUNT = r'''
import ctypes, json, os, sys
mode, base = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
# a mount namespace of this process's own: the writable mount below exists nowhere else
assert libc.unshare(0x20000) == 0 and libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0
folder, below = os.path.join(base, "ro"), os.path.join(base, "ro", "sub")
os.makedirs(below)
assert libc.mount(b"tmpfs", below.encode(), b"tmpfs", 0, b"size=1m,mode=1777") == 0
from scgrpo.verifiers.code import PythonTests
verifier = PythonTests(isolation=mode)
verifier.sandbox.binds.append(folder)  # bound read-only into the sandbox, the writable mount under it too
program = ("```python\ndef solve():\n    try:\n        open(%r, 'w').write('x')\n        return 1\n"
           "    except OSError:\n        return 0\n```" % os.path.join(below, "pwned"))
result = verifier.verify_batch([program], [[{"type": "call", "fn": "solve", "args": [], "expected": 1}]], ["q"])[0]
print(json.dumps({"score": result.score, "written": os.path.exists(os.path.join(below, "pwned"))}))
'''


@pytest.mark.parametrize("mode", ["bwrap", "namespaces"])
def test_a_writable_mount_under_a_read_only_folder_is_read_only_inside(mode, tmp_path):
    """A folder bound read-only with a writable mount below it (a tmpfs, made in a mount namespace of the test's
    own): the program cannot write there (namespaces mode remounted only the top of each bind)."""
    skip_unless(mode)
    if os.geteuid() != 0:
        pytest.skip("needs root: the writable mount is made in a mount namespace of the test's own")
    os.chmod(tmp_path, 0o755)
    done = subprocess.run([sys.executable, "-c", READ_ONLY_SUBMOUNT, mode, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {"score": 0.0, "written": False}


def _autogroups_schedule():
    """Why the scheduler does not share CPU between sessions here (None when it does): autogroups on, and this
    process in the root of the cpu controller (in a cpu cgroup of its own the cgroup's share is what counts)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return "the kernel's autogroups are off"
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                if ("cpu" in controllers.split(",") or controllers == "") and path not in ("/", ""):
                    return f"this process is in a cpu cgroup of its own ({path})"
    except OSError as err:
        return f"no autogroups here ({err})"
    return None


STARVE = ("import os, time\nfor _ in range(12):\n    if os.fork() == 0:\n        try:\n            os.setsid()\n"
          "        except OSError:\n            pass\n        while True:\n            pass\n"
          "def solve():\n    time.sleep(3.0)\n    return 0\n")
NEIGHBOUR = ("import time\ndef f(x):\n    t = time.process_time()\n    while time.process_time() - t < 0.3:\n"
             "        pass\n    return x\n")


@pytest.mark.parametrize("mode", ["bwrap", "namespaces"])
def test_a_program_that_forks_busy_sessions_leaves_its_neighbour_its_share(mode):
    """A program forks 12 busy loops, each in a session of its own (the scheduler gives each session, an autogroup,
    an equal share of the CPU: 12 sessions would take 12 shares). Beside it, a correct program needs 0.3 s of CPU
    in each of its 3 tests, within 1 s each (at 1.5 s it passes without the defence too). The sandbox refuses new sessions inside a program, so the busy loops
    share their program's one session: the neighbour keeps its share and scores 1 (it scored 0 or 1/3 before)."""
    skip_unless(mode)
    if _autogroups_schedule():
        pytest.skip(_autogroups_schedule())
    verifier = PythonTests(isolation=mode, workers=2, timeout_s=4.0, test_timeout_s=1.0, cpu_s=2, memory_mb=256,
                           processes=16)
    calls = [{"type": "call", "fn": "f", "args": [i], "expected": i} for i in range(3)]
    attacker, neighbour = verifier.verify_batch(
        [f"```python\n{STARVE}```", f"```python\n{NEIGHBOUR}```"],
        [[{"type": "call", "fn": "solve", "args": [], "expected": 1}], calls], ["q", "q"])
    assert attacker.score == 0.0, attacker.info
    assert neighbour.score == 1.0, neighbour.info


FORK_MEMORY = ("import os, time\nchildren = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
               "        held = [bytearray(8 << 20) for _ in range(15) if not time.sleep(0.005)]\n"
               "        time.sleep(30)\n        os._exit(0)\n    children.append(pid)\n"
               "def solve():\n    time.sleep(1.5)\n"
               "    return 1 if all(os.waitpid(p, os.WNOHANG) == (0, 0) for p in children) else 0\n")
HELD_MARGIN_MB = 256
"""What the program's processes may hold beyond ``memory_mb`` as measured here: what they allocate within one of the
judge's polls (20 ms) and its reading of their memory, and the pages that forks share, which each process's resident
count here includes in full"""


def _sandbox_anon_bytes():
    """Resident anonymous and shared-memory bytes of the sandboxes' processes, read from a live thread of each (a
    process whose first thread exited shows a zombie leader without memory fields while its other threads run)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if not UID_BASE <= os.stat(f"/proc/{pid}").st_uid < UID_BASE + UID_SPAN:
                continue
            for task in [pid, *os.listdir(f"/proc/{pid}/task")]:
                path = f"/proc/{pid}" if task == pid else f"/proc/{pid}/task/{task}"
                with open(f"{path}/status") as f:
                    status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                if "RssAnon" in status:
                    total += sum(int(status[k].split()[0]) for k in ("RssAnon", "RssShmem") if k in status) * 1024
                    break
        except (OSError, ValueError):
            continue
    return total


# each fork's first thread exits once another holds the memory: the process shows a zombie leader without memory
# fields while the memory stays held (the judge reads a live thread's)
FORK_MEMORY_ZOMBIE_LEADER = FORK_MEMORY.replace(
    "        held = [bytearray(8 << 20) for _ in range(15) if not time.sleep(0.005)]\n"
    "        time.sleep(30)\n        os._exit(0)\n",
    "        import ctypes, threading\n        def hold():\n            time.sleep(0.3)\n"
    "            held = [bytearray(8 << 20) for _ in range(15) if not time.sleep(0.005)]\n            time.sleep(30)\n"
    "        threading.Thread(target=hold).start()\n        ctypes.CDLL(None).syscall(60 if os.uname().machine == "
    "'x86_64' else 93, 0)\n")


@pytest.mark.parametrize("variant", ["forks", "stop_the_judge", "zombie_leaders", "odd_name"])
@pytest.mark.parametrize("mode", ["bwrap", "namespaces"])
def test_forked_children_are_held_to_the_memory_limit_together(mode, variant):
    """A program forks 6 children that each hold 120 MiB (each under its own 256 MiB address-space limit: 720 MiB
    together), and scores 1 if they all still live when the test runs. The judge sums its processes' memory and
    kills them past ``memory_mb``: the program scores 0, and what its processes held, polled from here every 10 ms,
    stays under ``memory_mb`` + :data:`HELD_MARGIN_MB`. The same when the program first sends SIGSTOP to the judge,
    its parent (the judge is its pid namespace's init, which that signal does not reach: stopped, it would hold
    808 MiB until the host's deadline), and when each fork's first thread exits while another holds the memory
    (a zombie leader shows no memory fields: about 987 MiB went uncounted), and when its processes' name is not
    UTF-8."""
    skip_unless(mode)
    program = {"forks": FORK_MEMORY, "stop_the_judge": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n"
               + FORK_MEMORY, "zombie_leaders": FORK_MEMORY_ZOMBIE_LEADER,
               # a name that is not UTF-8 in /proc/<pid>/status (it ended a watch that decoded it strictly)
               "odd_name": "import ctypes\nctypes.CDLL(None).prctl(15, b'\\xff\\xfe', 0, 0, 0)\n" + FORK_MEMORY}[variant]
    verifier = PythonTests(isolation=mode, workers=1, timeout_s=4.0, test_timeout_s=3.0, cpu_s=2, memory_mb=256,
                           processes=16)
    peak, stop = [0], threading.Event()

    def poll():
        while not stop.wait(0.01):
            peak[0] = max(peak[0], _sandbox_anon_bytes())

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        result = verifier.verify_batch([f"```python\n{program}```"], [_call(1)], ["q"])[0]
    finally:
        stop.set()
        watcher.join()
    assert result.score == 0.0, result.info
    assert "memory limit" in str(result.info["tests"]), result.info
    if os.geteuid() == 0:  # (the sandbox's processes are found here by the uids it gives them as root)
        assert 0 < peak[0] <= (256 + HELD_MARGIN_MB) << 20, peak[0] >> 20
