"""The host side of the code sandbox: picks the strongest isolation this machine allows, runs one program's
tests in it (``sandbox_harness.py`` runs inside) and leaves nothing behind.

Layers, strongest first; ``mode="auto"`` takes the first that passes a probe run and logs which:

``bwrap``
    bubblewrap: new network, pid, ipc and uts namespaces; a new root holding only the system and Python
    folders, read-only; a sized tmpfs on /tmp as the only writable place; a pid namespace that dies with it.
``namespaces``
    the same built with ``unshare(2)`` and ``mount(2)`` by the judge itself, where the host lets it (root).
``process``
    no namespaces: only the layers below. The program can reach the network and read what the user can.

Every mode also has: resource limits (CPU seconds per test, address space, file size, open files, no core
files), a session and process group of its own killed whole at the end, an empty working folder, a scrubbed
environment, no standard input, captured and capped output, a wall-clock limit, and no new privileges. When the
host runs as root, the program also gets a uid of its own (so the process limit counts exactly its processes,
all of them are killed by uid at the end, even a daemon that left the session, and it can neither signal the
trainer nor read or write root's files). As root, a program never runs as uid 0: where no mode can give it a
uid of its own, no mode works. In the ``process`` mode as another user, the trainer is made non-dumpable, so
that the program (same uid) can read neither its memory nor its file descriptors.

Where the host offers a memory cgroup (:mod:`scgrpo.verifiers.cgroup`), each program runs in one of its own: the
kernel holds everything the program's processes and its judge hold, kernel memory included, to ``memory_mb`` +
``JUDGE_MB``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import select
import shutil
import site
import signal
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence, Union

from scgrpo.verifiers.base import VerifierSetupError
from scgrpo.verifiers.cgroup import ProgramCgroup, find_base
from scgrpo.verifiers.sandbox_harness import decode

log = logging.getLogger(__name__)

MODES = ("bwrap", "namespaces", "process")
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
UID_BASE, UID_SPAN = 1_600_000_000, 1 << 24
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
PR_SET_DUMPABLE = 4
JUDGE_GRACE_S = 1.0
"""Seconds past ``timeout_s`` the host waits for the judge's results (the judge stops before ``timeout_s``)."""
JUDGE_MB = 256
"""What the judge and the sandbox's own processes may hold beside the program, inside the program's memory cgroup"""


class SandboxError(VerifierSetupError):
    """The sandbox itself failed (not the program in it): the run cannot be scored and stops."""


@dataclass
class Limits:
    """What one program may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds for the whole program, all its tests; tests it did not reach count as timeouts."""
    test_timeout_s: float = 2.0
    """Wall-clock seconds for one test (and for loading the program)."""
    cpu_s: int = 5
    """CPU seconds per process and test (the program's process is replaced once it has used some)."""
    memory_mb: int = 1024
    """Address space per process, and the anonymous and shared memory of all the program's processes together (the
    judge's watch, where they can be told apart: a pid namespace or a uid of its own); where the host offers a
    memory cgroup, also everything the kernel charges to the sandbox, kernel memory and the judge included, within
    ``memory_mb`` + ``JUDGE_MB``."""
    processes: int = 32
    """Processes and threads (needs a uid of its own, i.e. a root host, or bubblewrap's user namespace)."""
    file_mb: int = 16
    """Largest file it may write."""
    disk_mb: int = 64
    """Size of its writable /tmp (namespaced modes)."""
    disk_files: int = 4096
    """Files and folders it may make in its /tmp (the tmpfs's inodes: each is kernel memory; namespaced modes, and
    bubblewrap as root)."""
    open_files: int = 64
    """Open file descriptors per process."""
    output_kb: int = 1024
    """Standard output kept per test; more fails the test."""


@dataclass
class Outcome:
    """What came back from one run: ``results`` (one dict per test, from the judge) or ``failure`` (why there is
    no verdict: a timeout, or the program killed the judge)."""

    results: Optional[list[dict[str, Any]]]
    failure: Optional[str] = None


def result_value(result: dict[str, Any]) -> Any:
    """The value a call test's program returned, from the judge's result (``value_json``: its tagged JSON, kept as
    text until the host reads it)."""
    return decode(json.loads(result["value_json"]))


def _python_folders() -> list[str]:
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for getter in (site.getsitepackages, lambda: [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        try:
            paths.update(getter())
        except Exception:  # some embedded interpreters lack site's helpers
            pass
    return [os.path.realpath(p) for p in paths if os.path.isdir(p)]


def _layout_paths() -> tuple[list[str], list[tuple[str, str]]]:
    """Folders to bind read-only into the new root and the system symlinks (/bin -> usr/bin) to recreate."""
    binds, links = [], []
    for path in SYSTEM:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            binds.append(path)
    for path in sorted(_python_folders()):
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
            binds = [b for b in binds if not b.startswith(path.rstrip("/") + "/")] + [path]
    return binds, links


def _ancestors(path: str) -> list[str]:
    parts, out = path.strip("/").split("/"), []
    for i in range(1, len(parts)):
        out.append("/" + "/".join(parts[:i]))
    return out


def _parent_modes(binds: list[str]) -> dict[str, int]:
    """The folders the new root makes to hold the binds (their parents that are not bound themselves), each with
    its host mode less every write bit, plus the search bits that reach what is bound below it: no more open than on
    the host (a ``/root`` of mode 0700 is 0511 inside: the bound Python under it is reachable, nothing else there
    is listed)."""
    modes = {}
    for path in binds:
        for parent in _ancestors(path):
            if parent not in binds and parent != "/tmp":
                try:
                    host = os.stat(parent).st_mode & 0o555
                except OSError:
                    host = 0o555
                modes[parent] = host | 0o111
    return modes


class Sandbox:
    """Runs programs against tests, one sandbox each. Thread-safe: call :meth:`run` from many threads.

    Args:
        mode: ``auto`` (the strongest that works here), or one of ``bwrap``, ``namespaces``, ``process``;
            a mode that does not work here raises :class:`SandboxError`.
        limits: see :class:`Limits`.
    """

    def __init__(self, mode: str = "auto", limits: Optional[Limits] = None) -> None:
        if mode not in ("auto", *MODES):
            raise ValueError(f"isolation={mode!r}: expected auto, {', '.join(MODES)}")
        self.limits = limits or Limits()
        with open(HARNESS) as f:
            self.harness = f.read()
        self.binds, self.links = _layout_paths()
        self.is_root = os.geteuid() == 0
        self._uids: set[int] = set()
        self._uid_lock = threading.Lock()
        self._said_no_group = False  # (a cgroup that could not be made was logged)
        self._writable: Optional[list[str]] = None  # (process mode: where a program's uid may leave files)
        self._probed: dict[tuple[str, bool], Optional[str]] = {}  # (mode, own uid) -> why it does not work here
        self._warned_seccomp = False  # (said once: the filter could not be installed)
        self.cgroup_base, self._no_cgroup = find_base()  # where programs' memory cgroups go, or why none
        self.mode, self.separate_uid = self._choose(mode)
        if self.mode == "process" and not self.separate_uid:
            _make_undumpable()

    # ------------------------------------------------------------------ choosing a mode

    def _choose(self, wanted: str) -> tuple[str, bool]:
        tried = []
        for mode in MODES if wanted == "auto" else (wanted,):
            # as root the program always gets a uid of its own: as uid 0 it could read the judge's memory
            # (and forge its verdict), leave root daemons or kill the trainer
            for separate_uid in ((True,) if self.is_root else (False,)):
                if mode == "process" and separate_uid and not self._python_reachable_by_others():
                    tried.append(f"process: running as root, the program must run as another user, who cannot "
                                 f"reach {os.path.realpath(sys.executable)} (a folder above it is closed to others); "
                                 "install bubblewrap or use a Python that all users can run")
                    continue
                error = self._probe(mode, separate_uid)
                if error is None:
                    self._announce(mode, separate_uid, tried)
                    return mode, separate_uid
                tried.append(f"{mode}{' (own uid)' if separate_uid else ''}: {error}")
        raise SandboxError("no sandbox works here: " + "; ".join(tried))

    def _python_reachable_by_others(self) -> bool:
        path = os.path.realpath(sys.executable)
        return all(os.stat(p).st_mode & 0o001 for p in _ancestors(path)) and bool(os.stat(path).st_mode & 0o001)

    def _probe(self, mode: str, separate_uid: bool) -> Optional[str]:
        key = (mode, separate_uid)  # (probed while the instance is made: one thread)
        if key not in self._probed:
            if mode == "bwrap" and shutil.which("bwrap") is None:
                self._probed[key] = "bubblewrap (bwrap) is not installed"
            elif mode == "namespaces" and not self.is_root:
                self._probed[key] = "needs root"
            else:
                try:
                    out = self._run(mode, separate_uid, "def f(x):\n    return x + 1\n",
                                    [{"type": "call", "fn": "f", "args": [1]}], "")
                    ok = out.results is not None and "value_json" in out.results[0] \
                        and result_value(out.results[0]) == 2
                    self._probed[key] = None if ok else f"probe program failed: {out.failure or out.results}"
                except SandboxError as err:
                    self._probed[key] = str(err)
        return self._probed[key]

    def _announce(self, mode: str, separate_uid: bool, tried: list[str]) -> None:
        lim = self.limits
        common = (f"limits: {lim.cpu_s} s CPU, {lim.memory_mb} MiB memory, {lim.file_mb} MiB files, "
                  f"{lim.open_files} open files, {lim.test_timeout_s} s a test, {lim.timeout_s} s a program; own "
                  "session killed whole, empty folder, scrubbed environment, no stdin, capped output")
        uid = f"; a uid of its own, at most {lim.processes} processes" if separate_uid else ""
        if self.cgroup_base is not None:
            common += (f"; a memory cgroup (v{self.cgroup_base.version}) per program: at most {lim.memory_mb} + "
                       f"{JUDGE_MB} MiB, kernel memory and the judge's included")
        else:
            log.warning("code sandbox: no memory cgroup (%s): a program's memory is bounded by the address-space limit "
                        "of each process and the judge's watch over its processes' pages (every 20 ms); its kernel "
                        "memory (IPC objects, socket buffers, memory no process maps: secret memory, spliced pages) "
                        "only by the refusals listed in docs/verifiers.md, its tmpfs inodes by the mounts' caps, and "
                        "the judge's own memory by its caps on what it keeps",
                        self._no_cgroup)
        if mode == "process":
            log.warning(
                "code sandbox: process limits only (%s%s). It CANNOT ISOLATE THE NETWORK: programs under test can "
                "open connections%s. Install bubblewrap (apt-get install bubblewrap) for namespaces.%s",
                common, uid, "" if separate_uid else (
                    ", read and write what this user can, leave daemons, and signal (kill) this user's processes, "
                    "the trainer included; the trainer is made non-dumpable so that they cannot read its memory "
                    "or file descriptors (debuggers cannot attach to it either)"),
                (" Not available: " + "; ".join(tried)) if tried else "")
        else:
            what = "bubblewrap" if mode == "bwrap" else "namespaces (unshare)"
            log.info("code sandbox: %s: no network, own pid/ipc/uts namespaces, a new root with the system and "
                     "Python read-only, only a %d MiB /tmp writable%s; %s", what, lim.disk_mb, uid, common)
            if tried:
                log.info("code sandbox: not used: %s", "; ".join(tried))

    def describe(self) -> str:
        return self.mode + ("+uid" if self.separate_uid else "")

    # ------------------------------------------------------------------ running one program

    def run(self, code: str, tests: list[dict[str, Any]], setup: str = "",
            entry_points: Union[str, Sequence[str], None] = None) -> Outcome:
        """Runs ``code`` against ``tests`` (as the judge expects them: no expected outputs for call and stdio
        tests). ``entry_points`` names the functions the assert tests test, even when named like builtins: a
        program must define one of those the tests read by name.
        Raises :class:`SandboxError` only when the sandbox itself could not be set up."""
        points = [entry_points] if isinstance(entry_points, str) else list(entry_points or [])
        return self._run(self.mode, self.separate_uid, code, tests, setup, points)

    def _new_uid(self) -> int:
        with self._uid_lock:
            while True:
                uid = UID_BASE + random.randrange(UID_SPAN)
                if uid not in self._uids:
                    self._uids.add(uid)
                    return uid

    def _run(self, mode: str, separate_uid: bool, code: str, tests: list[dict[str, Any]], setup: str,
             entry_points: Sequence[str] = ()) -> Outcome:
        lim = self.limits
        uid = self._new_uid() if separate_uid else None
        folder = tempfile.mkdtemp(prefix="scgrpo-sandbox-")
        workdir = "/tmp"
        if mode == "process":  # its own folder inside one it cannot write: it can neither rename nor leave it
            workdir = os.path.join(folder, "work")
            try:
                os.mkdir(workdir, 0o700)
                os.chmod(folder, 0o711)
                if uid is not None:
                    os.chown(workdir, uid, uid)
            except OSError:
                self._clean(None, uid, folder)
                raise
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        token, parents = secrets.token_hex(16), _parent_modes(self.binds)
        deadline = time.monotonic() + lim.timeout_s
        job = {
            "token": token, "code": code, "tests": tests, "setup": setup, "entry_points": list(entry_points),
            "harness": self.harness, "python": sys.executable, "env": env, "limits": asdict(lim), "deadline": deadline,
            "layout": {"mode": mode, "uid": uid, "root": folder, "workdir": workdir, "binds": self.binds,
                       "symlinks": self.links, "parents": parents, "disk_mb": lim.disk_mb,
                       "disk_files": lim.disk_files, "remount_tmp": mode == "bwrap",
                       "nproc": uid is not None or (mode == "bwrap" and _nproc_per_user_namespace())},
        }
        job_read, job_write = os.pipe()
        result_read, result_write = os.pipe()
        python = [sys.executable, "-I", "-S", "-B", "-c", self.harness, "judge", str(job_read), str(result_write)]
        command = self._bwrap(env, parents) + python if mode == "bwrap" else python
        process = group = None
        try:
            group = self._cgroup()
            if group is not None:
                command = group.command(command)
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env=env, start_new_session=True, close_fds=True, pass_fds=(job_read, result_write),
            )
            os.close(job_read)
            os.close(result_write)
            job_read = result_write = -1
            threading.Thread(target=_write_all, args=(job_write, json.dumps(job).encode()), daemon=True).start()
            job_write = -1
            outcome = self._collect(process, result_read, token, len(tests), deadline + JUDGE_GRACE_S)
            if group is not None and outcome.results is None and group.out_of_memory_kills():
                outcome = Outcome(None, f"memory limit: the sandbox held {lim.memory_mb} + {JUDGE_MB} MiB (its memory "
                                        f"cgroup), and the kernel ended its processes")
            return outcome
        finally:
            for fd in (job_read, result_write, job_write):
                if fd >= 0:
                    os.close(fd)
            os.close(result_read)
            self._clean(process, uid, folder, group, shared=mode == "process")

    def _cgroup(self) -> Optional[ProgramCgroup]:
        """The program's memory cgroup, or None where the host gives none (said once, at the start). Its name is
        drawn apart from the verdict's token (the program can read its cgroup's name)."""
        if self.cgroup_base is None:
            return None
        try:
            return self.cgroup_base.make(f"scgrpo-{secrets.token_hex(8)}", (self.limits.memory_mb + JUDGE_MB) << 20)
        except OSError as err:  # (out of cgroup ids, say): this program runs under the watch's bound alone
            with self._uid_lock:
                said, self._said_no_group = self._said_no_group, True
            if not said:
                log.warning("cannot make a program's memory cgroup under %s (%s): programs that meet this run under "
                            "the address-space limit and the judge's memory watch only", self.cgroup_base.path, err)
            return None

    def _bwrap(self, env: dict[str, str], parents: dict[str, int]) -> list[str]:
        lim = self.limits
        # --as-pid-1: the judge is its pid namespace's init, which the program's SIGSTOP and SIGKILL do not reach (a
        # stopped judge would stop its memory watch and timeouts until the host's deadline)
        command = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                   "--die-with-parent", "--new-session", "--as-pid-1"]
        if self.is_root:  # (the judge caps /tmp's inodes, then drops every capability with its uid)
            command += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SYS_ADMIN"]
        else:  # (in its own user namespace: the judge caps the inodes, then drops the capability)
            command += ["--unshare-user", "--cap-add", "CAP_SYS_ADMIN"]
        # the writable /tmp first: an interpreter that lives under /tmp (a venv there) is bound on top of it, not hidden
        command += ["--size", str(lim.disk_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
        made = {"/tmp"}
        for path in self.binds:
            for parent in _ancestors(path):
                if parent not in made and parent in parents:
                    made.add(parent)
                    command += ["--perms", f"{parents[parent]:04o}", "--dir", parent]
            command += ["--ro-bind", path, path]
        for link, target in self.links:
            command += ["--symlink", target, link]
        if self.is_root:
            command += ["--dev", "/dev"]
        else:  # the device nodes one by one: after bubblewrap's --dev the judge may not remount /tmp (EPERM)
            command += ["--tmpfs", "/dev"]
            for name in ("null", "zero", "full", "random", "urandom"):
                command += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
            for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                                 ("stderr", "/proc/self/fd/2")):
                command += ["--symlink", target, f"/dev/{name}"]
        command += ["--size", str(1 << 20), "--perms", "1777", "--tmpfs", "/dev/shm", "--proc", "/proc",
                    # the new root and /dev read-only (without root they would belong to the sandbox's user)
                    "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/tmp", "--clearenv"]
        for key, value in env.items():
            command += ["--setenv", key, value]
        return command

    def _collect(self, process, fd: int, token: str, count: int, deadline: float) -> Outcome:
        buffer, messages, confined = bytearray(), [], False
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                return Outcome(None, "timeout: the program ran past its wall-clock limit")
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            buffer += chunk  # (a bytearray: in place)
            if len(buffer) > 64 << 20:
                return Outcome(None, "the judge's answer is too long")
            while len(buffer) >= 4:
                (size,) = struct.unpack(">I", buffer[:4])
                if len(buffer) < 4 + size:
                    break
                messages.append(json.loads(bytes(buffer[4 : 4 + size])))
                del buffer[: 4 + size]
            for message in messages:
                confined = confined or message.get("confined", False)
                if message.get("seccomp") is False and not self._warned_seccomp:
                    self._warned_seccomp = True
                    log.warning("the code sandbox could not install its seccomp filter here: new user namespaces, "
                                "SysV IPC objects, memory files, sockets, larger socket buffers and io_uring are not "
                                "refused (see docs/verifiers.md)")
                if "results" in message:
                    if message.get("token") != token or len(message["results"]) != count:
                        return Outcome(None, "a verdict without the run's token")
                    return Outcome(message["results"])
            messages = []
        if not confined:
            process.wait(timeout=5)
            stderr = process.stderr.read(4000).decode("utf-8", "replace").strip() if process.stderr else ""
            raise SandboxError(f"the sandbox did not start (exit {process.returncode}): {stderr[-800:]}")
        return Outcome(None, "no verdict: the judge ended before the last test")

    def _clean(self, process, uid: Optional[int], folder: str, group: Optional[ProgramCgroup] = None,
               shared: bool = False) -> None:
        """Kills the session, then (with a uid of its own) every process of that uid, then every process left in the
        program's cgroup (removing it), then removes the folder; ``shared``: the program ran in the host's file
        system and IPC namespace, where what its uid left is removed too."""
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if uid is not None:
            for _ in range(50):  # kill -9 -1 as that uid: all its processes; repeat until there are none
                done = subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
                if done.returncode != 0:
                    break
        if process is not None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("code sandbox: process %d did not end after SIGKILL", process.pid)
            if process.stderr:
                process.stderr.close()
        if group is not None:
            try:
                group.remove()
            except OSError as err:
                log.warning("code sandbox: cgroup %s not removed: %s", group.path, err)
        if uid is not None and shared:  # (the namespaced modes' IPC objects and /tmp die with them)
            if self._writable is None:  # (once a sandbox: the folders other users may write to)
                self._writable = writable_folders()
            _remove_leftovers(uid, self._writable)
        shutil.rmtree(folder, ignore_errors=True)
        if uid is not None:
            with self._uid_lock:
                self._uids.discard(uid)


SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
"""Folders every user may write to: where a program of the ``process`` mode could leave files outside its own"""
WRITABLE_DEPTH = 4
"""How deep :func:`writable_folders` looks below each of :data:`SHARED_FOLDERS` and ``/var``"""


def writable_folders(tops: Sequence[str] = (*SHARED_FOLDERS, "/var"), depth: int = WRITABLE_DEPTH) -> list[str]:
    """:data:`SHARED_FOLDERS` and every folder other users may write to below them and below ``/var`` (``/tmp/.X11-unix``,
    ``/var/crash``: mode o+w), up to ``depth`` levels down, on the same file system, symbolic links not followed."""
    found = []
    for top in tops:
        try:
            device = os.lstat(top).st_dev
        except OSError:
            continue
        stack = [(top, 0)]
        while stack:
            path, level = stack.pop()
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISDIR(info.st_mode) or info.st_dev != device:
                continue
            if path in SHARED_FOLDERS or info.st_mode & stat.S_IWOTH:
                found.append(path)
            if level < depth:
                try:
                    stack += [(e.path, level + 1) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
                except OSError:
                    pass
    return sorted(set(found))
_IPC_TABLES = {"msg": (7, 9), "sem": (4, 6), "shm": (7, 9)}  # /proc/sysvipc table -> its owner's and creator's uid


def sysv_objects() -> list[tuple[str, int, tuple[int, ...]]]:
    """``(table, id, (owner uid, creator uid))`` of every SysV IPC object this IPC namespace shows
    (``/proc/sysvipc/msg``, ``sem`` and ``shm``; a table that cannot be read gives none)."""
    found = []
    for table, columns in _IPC_TABLES.items():
        try:
            with open(f"/proc/sysvipc/{table}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        found += [(table, int(row[1]), tuple(int(row[c]) for c in columns)) for row in rows if len(row) > max(columns)]
    return found


def _remove_leftovers(uid: int, folders: Sequence[str] = SHARED_FOLDERS) -> None:
    """What a program of the ``process`` mode, running as ``uid``, left outside its folder: its SysV IPC objects
    (where no seccomp filter refused them) and its files and folders in the ``folders`` every user can write to
    (:func:`writable_folders`: in each, at its top, where a program without other rights can make them)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    remove = {"msg": lambda i: libc.msgctl(i, 0, None), "sem": lambda i: libc.semctl(i, 0, 0),  # (IPC_RMID = 0)
              "shm": lambda i: libc.shmctl(i, 0, None)}
    for table, key, owners in sysv_objects():
        if uid in owners:
            remove[table](key)
    for shared in folders:
        try:
            entries = list(os.scandir(shared))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _nproc_per_user_namespace() -> bool:
    """Since Linux 5.14 RLIMIT_NPROC counts the processes of a uid in its user namespace, so that under bubblewrap
    (its own user namespace) it limits the sandbox's processes, not all of this user's."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def _make_undumpable() -> None:
    """The trainer non-dumpable: a program run as the same user can then neither read its memory nor open its
    file descriptors through /proc."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}")


def _write_all(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # the judge died before reading its job
        pass
    finally:
        os.close(fd)
