"""The two processes inside the code sandbox. Standard library only: the file's text is run with ``python -c``.

``judge`` (started by :mod:`scgrpo.verifiers.sandbox`, as root when the host is): reads the whole job from a pipe
(the program, its tests without expected outputs, the sandbox layout, the limits and a per-run token), sets up
the sandbox (in the "namespaces" mode: new namespaces, then a fork so that the judge is pid 1 of its pid
namespace, a new root and /proc; then a fresh uid, no new privileges, not dumpable), then starts the ``worker``
with ``execve`` -- a fresh address space that never held the job, under the resource limits -- and sends it
the program. For each test it asks the worker for an observation (a function's return
value, a program's standard output) or, for an ``assert`` test, runs the assertion itself over proxies whose
calls go to the worker. Only after the last test (or at the program's deadline, the unfinished tests
counted as timeouts) does it write ``{"token": ..., "results": [...]}`` to another pipe. A worker that timed
out, crashed or used up its CPU time is replaced by a fresh one for the next test.

The worker runs the program under test. It holds neither pipe, nor the token, nor any expected value,
and it cannot read the judge's memory or file descriptors (the judge is not dumpable): all it can do is answer
each question, and a wrong answer fails the test. Values cross as tagged JSON (plain data only), so an object
whose ``__eq__`` always returns True cannot reach a comparison.

Why one file of this length: the sandbox runs this file's text alone (``python -c``, inside a new root where the
package is not importable), so the judge, the worker and the JSON codec they share cannot be split into modules.
"""

import ast
import builtins
import ctypes
import json
import os
import select
import signal
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP = 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MAX_MESSAGE = 8 << 20  # (the host's job and the judge's questions)
REPLY_BYTES = 1 << 20
"""The largest reply of the program's process other than a stdio test's output (a value, an error, its names):
parsed, JSON of containers takes tens of times its size (8 MiB of a set of short strings held 562 MiB in the judge)"""
VERDICT_BYTES = 32 << 20
"""The most observations (values, outputs) the judge keeps for the host in all; past it a test fails"""
FRESH_CPU_S = 0.2  # a worker that has used more CPU time than this is replaced before the next test


# ---------------------------------------------------------------- plain values as tagged JSON


def encode(value, depth=0):
    """Plain data (None, bool, int, float, str, bytes, list, tuple, set, frozenset, dict) as JSON-able values;
    anything else raises TypeError."""
    if depth > 50:
        raise TypeError("nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return value if abs(value) < 2**53 else {"int": str(value)}
    if kind is float:
        return {"float": repr(value)}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"tuple": [encode(v, depth + 1) for v in value]}
    if kind in (set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is Remote:  # a test handing the program one of its own objects back
        return {"handle": value._handle()}
    raise TypeError(f"a value of type {kind.__name__} is not plain data")


def plain(value, depth=0):
    """``value`` with subclasses of plain types made plain (a ``Counter`` a dict, a ``namedtuple`` a tuple,
    ``numpy.int64`` an int, an array a list), run in the worker before :func:`encode`, which still checks
    what comes out."""
    if depth > 50:
        raise TypeError("nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, float, str, bytes):
        return value
    if (getattr(kind, "__module__", None) or "").split(".")[0] == "numpy":
        for method in ("tolist", "item"):
            if callable(getattr(value, method, None)):
                return plain(getattr(value, method)(), depth + 1)
    for base in (bool, int, float, str, bytes):
        if isinstance(value, base):  # str(): a (str, Enum) member's value, not its str() ("Color.RED")
            return str.__str__(value) if base is str else base(value)
    if isinstance(value, dict):
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in dict.items(value)}
    for base in (list, tuple, set, frozenset):
        if isinstance(value, base):
            return base(plain(v, depth + 1) for v in base.__iter__(value))
    return value


def decode(data, objects=None):
    """``encode``'s inverse; handles (``{"handle": i}``) are the worker's ``objects[i]``, and refused anywhere
    else (the host and the judge take no objects from the program)."""
    if isinstance(data, list):
        return [decode(v, objects) for v in data]
    if not isinstance(data, dict):
        return data
    ((tag, inner),) = data.items()
    if tag == "handle" and objects is not None and type(inner) is int and 0 <= inner < len(objects):
        return objects[inner]
    if tag == "int":
        return int(inner)
    if tag == "float":
        return float(inner)
    if tag == "bytes":
        return bytes.fromhex(inner)
    if tag == "tuple":
        return tuple(decode(v, objects) for v in inner)
    if tag == "set":
        return {decode(v, objects) for v in inner}
    if tag == "frozenset":
        return frozenset(decode(v, objects) for v in inner)
    if tag == "dict":
        return {decode(k, objects): decode(v, objects) for k, v in inner}
    raise ValueError(f"unknown tag {tag!r}")


# ---------------------------------------------------------------- framing


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def send(fd, message):
    data = json.dumps(message).encode()
    _write_all(fd, struct.pack(">I", len(data)) + data)


def _read_exact(fd, n, deadline):
    chunks, left = [], n
    while left:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class TooLarge(ValueError):
    """A message past the size its reader takes."""


def receive(fd, deadline=None, limit=MAX_MESSAGE):
    (size,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
    if size > limit:
        raise TooLarge(f"a reply of {size} bytes, at most {limit} taken")
    return json.loads(_read_exact(fd, size, deadline))


# ---------------------------------------------------------------- judge: sandbox set-up


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
                "relatime": 1 << 21}


def _mounts_under(folder):
    """``(mount point, its flags, read-only)`` of each mount below ``folder`` (its real path: mountinfo lists real
    ones) in this mount namespace, from ``/proc/self/mountinfo`` (the fifth field, whose spaces and other special
    characters are octal escapes, and the sixth, the mount's options)."""
    prefix, found = os.path.realpath(folder).rstrip("/") + "/", []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5:
                point = "".join(chr(int(part[:3], 8)) + part[3:] if i and part[:3].isdigit() else part
                                for i, part in enumerate(fields[4].split("\\")))
                options = fields[5].split(",")
                if point.startswith(prefix):
                    flags = sum(_MOUNT_FLAGS.get(option, 0) for option in set(options))
                    found.append((point, flags, "ro" in options))
    return found


SHM_OPTIONS = "size=1m,nr_inodes=64,mode=1777"


def _tmp_options(layout, mode=True):
    """The sandbox's /tmp: ``disk_mb`` of pages and ``disk_files`` inodes (each inode is kernel memory that no size
    counts: a million empty files held over 1 GiB of slab in a 16 MiB /tmp)."""
    return f"size={layout['disk_mb']}m,nr_inodes={layout['disk_files']}" + (",mode=1777" if mode else "")


def _build_root(libc, root, layout):
    """A new root in the private mount namespace: the system and Python folders bound read-only, a sized tmpfs
    on /tmp (the only writable place), a few device nodes, /proc; everything else (home folders, the run's
    folder, data files) is absent."""
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=256,mode=755")
    for link, target in layout["symlinks"]:
        os.symlink(target, root + link)
    # the writable /tmp first: an interpreter that lives under /tmp (a venv there) is bound on top of it, not hidden
    os.makedirs(root + "/tmp", mode=0o755, exist_ok=True)
    _mount(libc, "tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, _tmp_options(layout))
    for path in layout["binds"]:
        target = root + path
        os.makedirs(target, mode=0o755, exist_ok=True)
        for parent, mode in layout["parents"].items():  # (the host's modes, not more open: see _parent_modes)
            if path.startswith(parent + "/"):
                os.chmod(root + parent, mode)
        _mount(libc, path, target, None, MS_BIND | MS_REC)
        # read-only with every mount under it (a writable one there would stay writable: remounting the top
        # changes that mount alone)
        _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        for mount, flags, read_only in _mounts_under(target):  # (each keeps its own flags, which may be locked)
            try:
                _mount(libc, None, mount, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | flags)
            except OSError:
                if not read_only:  # (a mount hidden under another one cannot be reached, nor written)
                    raise
    os.makedirs(root + "/dev", mode=0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        open(root + "/dev/" + name, "w").close()
        _mount(libc, "/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    os.makedirs(root + "/dev/shm", mode=0o755)
    _mount(libc, "tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, SHM_OPTIONS)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    os.makedirs(root + "/proc", mode=0o755)
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(libc, None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/tmp")


def _drop_capabilities(libc):
    """No capability left, effective, permitted, inheritable or ambient (``capset`` may always drop them). With no
    new privileges and no file capabilities, no later ``execve`` gives any back."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)), (Data * 2)()), "capset")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def _confine(job, result_fd):
    """Everything that happens before the worker starts, in this order: namespaces, a fork (the judge becomes
    pid 1 of the new pid namespace, so that the namespace lives as long as the judge, not as long as its first
    worker) and the new root with that namespace's /proc (as root); the fresh uid, no new privileges, not
    dumpable. The resource limits are the worker's alone (:func:`_limit_worker`)."""
    layout = job["layout"]
    libc = _libc()
    if layout["mode"] == "namespaces":
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID | CLONE_NEWCGROUP),
               "unshare")
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
        child = os.fork()
        if child:  # outside the new pid namespace: wait for the judge, then end as it did
            os.close(result_fd)
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            _, status = os.waitpid(child, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        _build_root(libc, layout["root"], layout)
    else:
        if layout.get("remount_tmp"):  # bubblewrap sizes its tmpfs mounts but does not cap their inodes
            # (without mode=: bubblewrap made them 1777, and a user namespace's remount may not set it)
            _mount(libc, None, "/tmp", None, MS_REMOUNT | MS_NOSUID | MS_NODEV, _tmp_options(layout, mode=False))
            _mount(libc, None, "/dev/shm", None, MS_REMOUNT | MS_NOSUID | MS_NODEV, SHM_OPTIONS.replace(",mode=1777", ""))
            if layout.get("uid") is None:  # (bubblewrap's user namespace, for the remount alone: given up here)
                _drop_capabilities(libc)
        os.chdir(layout["workdir"])
    uid = layout.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")


def _limit_worker(limits, nproc):
    """Run in the worker's process before ``execve``: its resource limits, fresh for each worker."""
    import resource

    mb = 1 << 20
    for name, soft, hard in (
        ("RLIMIT_CPU", limits["cpu_s"], limits["cpu_s"] + 1),  # SIGXCPU, then SIGKILL a second later
        ("RLIMIT_AS", limits["memory_mb"] * mb, limits["memory_mb"] * mb),
        ("RLIMIT_FSIZE", limits["file_mb"] * mb, limits["file_mb"] * mb),
        ("RLIMIT_NOFILE", limits["open_files"], limits["open_files"]),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if nproc:  # per uid (or per user namespace): counts exactly the sandbox's processes
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
    os.setsid()
    if _NO_SESSIONS is not None:  # (built before the fork: here only the call that installs it)
        _install_filter(_NO_SESSIONS)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (the judge ignores it; the program gets Python's own handling)


# (seccomp: syscall numbers per audit architecture, x86_64 and aarch64)
_SYSCALLS = {
    0xC000003E: {"unshare": 272, "clone": 56, "clone3": 435, "shmget": 29, "shmat": 30, "memfd_create": 319,
                 "setsid": 112, "setsockopt": 54, "msgget": 68, "semget": 64, "socket": 41, "io_uring_setup": 425,
                 "add_key": 248, "request_key": 249, "keyctl": 250, "mq_open": 240, "memfd_secret": 447,
                 "vmsplice": 278, "socketpair": 53},
    0xC00000B7: {"unshare": 97, "clone": 220, "clone3": 435, "shmget": 194, "shmat": 196, "memfd_create": 279,
                 "setsid": 157, "setsockopt": 208, "msgget": 186, "semget": 190, "socket": 198, "io_uring_setup": 425,
                 "add_key": 217, "request_key": 218, "keyctl": 219, "mq_open": 180, "memfd_secret": 447,
                 "vmsplice": 75, "socketpair": 199},
}
_CLONE_NEWUSER = 0x10000000
_SOL_SOCKET, _SO_SNDBUF, _SO_RCVBUF, _SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 1, 7, 8, 32, 33
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ALLOW, _ERRNO | errno
_LOAD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
_AND = 0x54  # BPF_ALU|BPF_AND|BPF_K
_SOCK_STREAM, _SOCK_TYPE_MASK = 1, 0xF


def _seccomp_program(program):
    """A ``sock_fprog`` of the BPF ``program`` (``(code, jt, jf, k)`` tuples), kept with its filter array."""

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*op) for op in program])
    fprog = Program(len(program), filters)
    fprog.keep = filters  # (the array must outlive the structure that points to it)
    # everything the install calls, looked up and made here: a worker installs it between fork and exec, where the
    # judge's other thread (the memory watch) may hold locks
    return fprog, ctypes.byref(fprog), ctypes.CDLL(None, use_errno=True).prctl


def _install_filter(built):
    """Installs a filter built by :func:`_seccomp_program` (no new privileges must be set); True when it is."""
    _, ref, prctl = built
    if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # (which an unprivileged filter needs)
        return False
    return prctl(22, 2, ref, 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _no_new_sessions():
    """A filter (built in the judge, installed by each worker after it starts its own session) that makes
    ``setsid`` fail with EPERM for the worker and every process it starts. The scheduler shares the CPU between
    sessions (autogroups), not between processes: a program whose processes each started a session of their own
    would take a share per process from the programs scored beside it. Its processes stay in the worker's one
    session. Calls of another architecture are left to the judge's filter (:func:`_refuse_unbounded_memory`).
    None where seccomp's architecture is not known."""
    arch = _ARCH.get(os.uname().machine)
    if arch is None:
        return None
    return _seccomp_program([
        (_LOAD, 0, 0, 4),  # the architecture
        (_JEQ, 0, 3, arch),
        (_LOAD, 0, 0, 0),  # the syscall's number
        (_JEQ, 0, 1, _SYSCALLS[arch]["setsid"]),
        (_RET, 0, 0, _EPERM),
        (_RET, 0, 0, _ALLOW),
    ])


_NO_SESSIONS = None  # the judge's :func:`_no_new_sessions`, once confined


def _refuse_unbounded_memory():
    """A seccomp filter (kept across ``execve`` by the worker and every process it starts) on the ways to hold
    memory that no resource limit counts:

    - a user namespace of its own (where a tmpfs could be mounted and filled): ``unshare`` and ``clone`` with
      ``CLONE_NEWUSER`` fail with EPERM, and ``clone3`` with ENOSYS (its flags sit in memory a filter cannot
      read; the C library falls back to ``clone``);
    - SysV IPC objects (``shmget``, ``shmat``, ``msgget``, ``semget``: message queues and semaphore sets are
      kernel memory no limit of the process counts), POSIX message queues (``mq_open``), kernel keys
      (``add_key``, ``request_key``, ``keyctl``: a uid's keyring outlives its processes) and memory file
      descriptors (``memfd_create``, ``memfd_secret``: secret memory is mapped by no process once unmapped, so no
      watch sees it): EPERM;
    - ``vmsplice``: EPERM (a page spliced into a pipe stays pinned after the process unmaps it: one 4 KiB slice
      pins a whole huge page);
    - sockets other than stream socket pairs (``socket``, of every family, and ``socketpair`` of another type):
      EPERM. A TCP connection on the namespace's loopback grows its buffers by itself (autotuning), a Unix socket
      file under a bound folder would reach a server of the host (a datagram pair's ``sendmsg`` takes a path too),
      vsock may reach the machine's host; a stream ``socketpair`` (asyncio's self-pipe) still works;
    - ``io_uring_setup``: ENOSYS (its requests run setsockopt and the rest without passing this filter);
    - larger socket buffers (``setsockopt`` of ``SO_SNDBUF``, ``SO_RCVBUF`` and their ``FORCE`` forms): EPERM. Data
      queued in a socket pair is kernel memory no process's count includes (up to twice ``net.core.wmem_max`` a
      socket: 437 MiB in one process of 28 pairs on a machine with 4 MiB); at the default size (``wmem_default``,
      about 200 KiB) it is bounded by ``open_files``.

    Calls of another architecture than the machine's (32-bit ``int 0x80`` calls on x86_64, whose numbers differ)
    and x32 numbers are refused whole (ENOSYS). Installed in the judge once confined (no new privileges), so that
    the worker and every process it starts inherit it. Returns whether it is in place: where seccomp or the
    architecture is not available the program runs without it (the other layers stand), and the host says so."""
    arch = _ARCH.get(os.uname().machine)
    if arch is None:
        return False
    nr = _SYSCALLS[arch]
    program = [
        (_LOAD, 0, 0, 4),  # the architecture
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, _ENOSYS),  # (a 32-bit call: its numbers differ)
        (_LOAD, 0, 0, 0),  # the syscall's number
        (_JGE, 0, 1, 0x40000000),  # (x32's numbers)
        (_RET, 0, 0, _ENOSYS),
    ]
    for name, errno in (("clone3", _ENOSYS), ("shmget", _EPERM), ("shmat", _EPERM), ("memfd_create", _EPERM),
                        ("memfd_secret", _EPERM), ("msgget", _EPERM), ("semget", _EPERM), ("mq_open", _EPERM),
                        ("io_uring_setup", _ENOSYS), ("socket", _EPERM), ("add_key", _EPERM),
                        ("request_key", _EPERM), ("keyctl", _EPERM), ("vmsplice", _EPERM)):
        program += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, errno)]
    program += [  # socketpair of a type other than SOCK_STREAM (a datagram pair can send to a path): EPERM
        (_JEQ, 0, 5, nr["socketpair"]),
        (_LOAD, 0, 0, 24),  # the type (the second argument's low half; its flags above the low 4 bits)
        (_AND, 0, 0, _SOCK_TYPE_MASK),
        (_JEQ, 1, 0, _SOCK_STREAM),
        (_RET, 0, 0, _EPERM),
        (_RET, 0, 0, _ALLOW),
    ]
    program += [  # setsockopt(SOL_SOCKET, SO_SNDBUF / SO_RCVBUF / their FORCE forms): EPERM
        (_JEQ, 0, 9, nr["setsockopt"]),
        (_LOAD, 0, 0, 24),  # the level (the second argument's low half)
        (_JEQ, 0, 6, _SOL_SOCKET),
        (_LOAD, 0, 0, 32),  # the option
        (_JEQ, 3, 0, _SO_SNDBUF),
        (_JEQ, 2, 0, _SO_RCVBUF),
        (_JEQ, 1, 0, _SO_SNDBUFFORCE),
        (_JEQ, 0, 1, _SO_RCVBUFFORCE),
        (_RET, 0, 0, _EPERM),
        (_RET, 0, 0, _ALLOW),
    ]
    program += [
        (_JEQ, 1, 0, nr["unshare"]),
        (_JEQ, 0, 3, nr["clone"]),
        (_LOAD, 0, 0, 16),  # the low half of its first argument: the flags
        (_JSET, 0, 1, _CLONE_NEWUSER),
        (_RET, 0, 0, _EPERM),
        (_RET, 0, 0, _ALLOW),
    ]
    return _install_filter(_seccomp_program(program))


# ---------------------------------------------------------------- judge: running the tests


class JudgeTimeout(BaseException):
    """A test ran past its time. A BaseException, like :class:`WorkerGone`: the judge's own, which a test's
    ``except Exception`` does not catch (and were it caught, the judge still records it: ``Worker.fault``)."""


class WorkerGone(BaseException):
    """The program's process ended (crash, exit, CPU limit) or failed to load the program."""


MEMORY_POLL_S = 0.02
"""How often the judge sums the memory of the program's processes (:class:`MemoryWatch`): what they allocate
within one poll is the margin past ``memory_mb`` (at 50 ms, 6 forks touching 120 MiB each on 2 cores held up to
552 MiB against a 256 MiB limit)"""


def _fields(path):
    """The ``name: value`` lines of a ``/proc`` file such as ``status`` or ``smaps_rollup`` (bytes decoded
    leniently: a process names itself as it likes)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _live_task(pid):
    """The ``/proc`` folder of a live task of process ``pid`` and its status fields: the process's own, or, where
    its first thread has exited (a zombie leader: no memory fields) while others run, one of theirs (threads share
    the memory). None when there is none, or the process is not the judge's uid."""
    folders = [f"/proc/{pid}"]
    for folder in folders:
        try:
            fields = _fields(f"{folder}/status")
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) != os.getuid():
            return None
        if "RssAnon" in fields:
            return folder, fields
        if len(folders) == 1:
            try:
                folders += [f"/proc/{pid}/task/{tid}" for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
            except OSError:
                return None
    return None


def _kib(fields, keys):
    return sum(int(fields[k].split()[0]) for k in keys if k in fields) * 1024


def _held_bytes(pid, proportional=False):
    """Anonymous and shared-memory bytes process ``pid`` holds, read from a live thread's folder
    (:func:`_live_task`): its resident pages (``RssAnon`` + ``RssShmem`` of ``status``: cheap, each fork's shared
    pages in full), or with ``proportional`` its share of them (``Pss_Anon`` + ``Pss_Shmem`` of ``smaps_rollup``,
    whose reading takes time in proportion to the process's mappings: pages a fork shares count once in all; the
    resident count where that is not readable). None when the process is gone or is not the judge's uid."""
    found = _live_task(pid)
    if found is None:
        return None
    folder, fields = found
    try:
        if proportional:
            rollup = _fields(f"{folder}/smaps_rollup")
            if "Pss_Anon" in rollup and "Pss_Shmem" in rollup:
                return _kib(rollup, ("Pss_Anon", "Pss_Shmem"))
    except OSError:
        pass
    try:
        return _kib(fields, ("RssAnon", "RssShmem"))
    except ValueError:
        return None


class MemoryWatch:
    """A thread of the judge that sums, every :data:`MEMORY_POLL_S`, the memory the program's processes hold
    together (every process of the judge's uid but the judge and its parent: the worker and whatever it forked)
    and, past ``limit`` bytes, kills them all, as :meth:`Worker.stop` does; the worker's question then fails with
    the memory limit as its reason. Each poll sums the cheap resident counts; only past the limit are the
    proportional shares read (forks' shared pages once), and they decide. ``RLIMIT_AS`` bounds each process; this
    bounds their sum (forked children each under the limit), up to what they allocate within one poll. Only where
    the program's processes can be told apart: a pid namespace or a uid of its own (``isolated``)."""

    def __init__(self, limit, isolated):
        import threading

        self.limit, self.isolated = limit, isolated
        self.exceeded = None  # bytes held when the limit was passed (cleared when a worker starts)
        self.generation = 0  # the worker's (set by Worker.start): a poll begun under another does not kill
        self._skip = {os.getpid(), os.getppid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if isolated:
            self._thread.start()

    def held(self, proportional=False):
        total, uid = 0, os.getuid()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in self._skip:
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:  # (cheap: a host's /proc in the process mode)
                    continue
            except OSError:
                continue
            total += _held_bytes(int(name), proportional) or 0
        return total

    def _run(self):
        while not self._stop.wait(MEMORY_POLL_S):
            try:
                generation = self.generation
                if self.held() <= self.limit:
                    continue
                total = self.held(proportional=True)
                if total > self.limit and generation == self.generation:
                    self.exceeded = total
                    os.kill(-1, signal.SIGKILL)  # (every process the judge may signal, itself aside)
            except Exception:  # noqa: BLE001 - a process that vanished or named itself oddly: the next poll
                continue

    def close(self):
        self._stop.set()


class Worker:
    """The program's process, spoken to over two pipes. ``deadline`` (monotonic seconds) is the program's: no
    question waits past it."""

    def __init__(self, job, deadline):
        self.job = job
        self.deadline = deadline
        self.process = None
        self.loaded = None
        self.names = []
        self.generation = 0  # counts the program's processes: a handle is good only in the one that made it
        self.holds_objects = False  # the tests keep handles into this process: its state is theirs to keep
        self.failed = {}  # name -> why loading the program failed: later tests fail at once
        self.cpu_at_stop = 0.0
        self.alarm_at = None  # the deadline of the assert test running in the judge
        self.fault = None  # the JudgeTimeout or WorkerGone of the test running now, caught or not
        # kill(-1) reaches only the sandbox's processes: those of its pid namespace, or of its own uid
        self.isolated = job["layout"]["mode"] != "process" or job["layout"].get("uid") is not None
        self.memory = MemoryWatch(job["limits"]["memory_mb"] << 20, self.isolated)

    def until(self, seconds):
        return min(time.monotonic() + seconds, self.deadline)

    def start(self, name):
        import subprocess

        worker_reads, judge_writes = os.pipe()
        judge_reads, worker_writes = os.pipe()
        limits, nproc = self.job["limits"], self.job["layout"]["nproc"]
        self.process = subprocess.Popen(
            [self.job["python"], "-I", "-B", "-c", self.job["harness"], "worker", str(worker_reads), str(worker_writes)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(worker_reads, worker_writes), env=self.job["env"], close_fds=True,
            preexec_fn=lambda: _limit_worker(limits, nproc),
        )
        os.close(worker_reads)
        os.close(worker_writes)
        self.send_fd, self.recv_fd = judge_writes, judge_reads
        self.generation += 1
        self.memory.exceeded, self.memory.generation = None, self.generation
        self.holds_objects = False
        try:
            reply = self.ask({"op": "load", "code": self.job["code"], "name": name,
                              "output_cap": limits["output_kb"] * 1024}, self.until(limits["test_timeout_s"]))
        except JudgeTimeout:
            self.failed[name] = "timeout"
            raise
        except WorkerGone as err:
            self.failed[name] = str(err)
            raise
        if "error" in reply:
            self.failed[name] = reply["error"]
            self.stop()
            raise self.gone(reply["error"])
        self.loaded, self.names = name, reply.get("names", [])
        return reply

    def gone(self, why):
        self.fault = WorkerGone(why)
        return self.fault

    def timed_out(self):
        self.fault = JudgeTimeout()
        return self.fault

    def ask(self, message, deadline):
        if self.process is None:  # stopped during this test (its pipes are closed)
            raise self.fault or self.gone("the program's process ended")
        try:
            send(self.send_fd, message)
            reply = receive(self.recv_fd, deadline, REPLY_BYTES)
            if message["op"] == "stdio":  # its output follows as raw bytes (never parsed), at most output_kb + 1
                size, cap = reply.get("stdout_bytes"), self.job["limits"]["output_kb"] * 1024 + 1
                if type(size) is not int or not 0 <= size <= cap:
                    raise TooLarge(f"an output of {size!r} bytes, at most {cap} taken")
                reply["stdout"] = _read_exact(self.recv_fd, size, deadline).decode("utf-8", "replace") if size else ""
            return reply
        except TimeoutError:
            self.stop()
            raise self.timed_out() from None
        except TooLarge as err:
            self.stop()
            raise self.gone(f"the program's reply is too large ({err})") from None
        except (EOFError, OSError, ValueError, struct.error) as err:
            status = self.stop()
            if self.memory.exceeded is not None:
                held, self.memory.exceeded = self.memory.exceeded, None
                raise self.gone(f"memory limit ({self.job['limits']['memory_mb']} MiB for all the program's "
                                f"processes) exceeded: {held >> 20} MiB held") from None
            if status == -signal.SIGXCPU or (status == -signal.SIGKILL and self.cpu_at_stop >= self.job["limits"]["cpu_s"]):
                raise self.gone(f"CPU time limit ({self.job['limits']['cpu_s']} s) exceeded") from None
            raise self.gone(f"the program's process ended ({type(err).__name__}: {err})") from None

    def cpu_used(self):
        """CPU seconds the worker has used (0 when unreadable)."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def stop(self):
        """Kills the worker, its process group and (in a namespaced sandbox) every other process in it; returns
        the worker's exit status."""
        if self.process is None:
            return None
        self.cpu_at_stop = self.cpu_used()
        for kill in (lambda: os.killpg(self.process.pid, signal.SIGKILL), self.process.kill,
                     lambda: os.kill(-1, signal.SIGKILL) if self.isolated else None):
            try:
                kill()
            except OSError:
                pass
        status = self.process.wait()
        _reap()
        os.close(self.send_fd)
        os.close(self.recv_fd)
        self.process, self.loaded = None, None
        return status

    def ensure(self, name):
        if name in self.failed:
            if self.failed[name] == "timeout":
                raise self.timed_out()
            raise self.gone(self.failed[name])
        if self.process is not None and not self.holds_objects and self.cpu_used() > FRESH_CPU_S:
            self.stop()  # each test starts with (nearly) the whole CPU limit, whatever ran before it (unless the
            # tests hold objects of this process: a stack pushed in one test is popped in the next)
        if self.process is None or self.loaded != name:
            self.stop()
            self.start(name)


def _reap():
    """As pid 1 of its namespace the judge inherits the orphans of the program: collect the dead ones."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _proxy(worker, name, timeout):
    def call(*args, **kwargs):
        return _answer(worker, {"op": "call", "fn": name, "args": encode(list(args)), "kwargs": encode(kwargs),
                                "handles": True}, name, timeout)

    call.__name__ = name
    return call


def _answer(worker, request, name, timeout):
    """The worker's reply to a proxy's request as the test sees it: a plain value, the program's exception,
    or a :class:`Remote` for an object that is not plain data."""
    return _reply(worker, worker.ask(request, worker.until(timeout)), name, timeout)


def _reply(worker, reply, name, timeout):
    if "error" in reply:
        raise _program_error(name, reply)
    if "handle" in reply:
        return Remote(worker, reply["handle"], str(reply.get("type", "object")), timeout)
    return decode(reply["value"])


class Remote:
    """An object of the program's (``Solution()``, a class it defines, a generator) seen from the tests: its
    attributes, methods, length, items, iteration (one item at a time) and text are read in the worker, plain
    values (or more handles) coming back, and a test may hand it back to the program's functions; the object
    never leaves the worker. ``==``, ``!=`` and hashing raise: only plain data compares (``in`` compares the
    items here, so the program's ``__contains__`` cannot decide it). A handle from a program process that has
    since been restarted raises too."""

    __hash__ = None  # a set or dict lookup would never reach __eq__

    def __init__(self, worker, handle, kind, timeout):
        object.__setattr__(self, "_where", (worker, handle, kind, timeout, worker.generation))

    def _handle(self):
        worker, handle, kind, _, generation = object.__getattribute__(self, "_where")
        if generation != worker.generation:
            raise RuntimeError(f"the program's {kind} object is gone: its process was restarted")
        return handle

    def _ask(self, op, label, **fields):
        worker, _, kind, timeout, _ = object.__getattribute__(self, "_where")
        request = {"op": op, "handle": self._handle(), **fields}
        return _answer(worker, request, f"{kind}{label}", timeout)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("attr", f".{name}", name=name)

    def __setattr__(self, name, value):
        self._ask("setattr", f".{name}", name=name, value=encode(value))

    def __call__(self, *args, **kwargs):
        return self._ask("call", "", args=encode(list(args)), kwargs=encode(kwargs), handles=True)

    def __bool__(self):  # the object's own truth value (plain True or False), as the test would see it unsandboxed
        return self._ask("special", "", name="bool", args=[]) is True

    def __len__(self):
        return self._ask("special", "", name="len", args=[])

    def __iter__(self):
        return self._ask("special", "", name="iter", args=[])  # a handle to the worker's iterator

    def __next__(self):
        worker, _, kind, timeout, _ = object.__getattribute__(self, "_where")
        reply = worker.ask({"op": "next", "handle": self._handle()}, worker.until(timeout))
        if reply.get("done") is True:
            raise StopIteration
        return _reply(worker, reply, kind, timeout)

    def __getitem__(self, key):
        return self._ask("special", "", name="getitem", args=encode([key]))

    def __str__(self):
        return self._ask("special", "", name="str", args=[])

    def __eq__(self, other):
        raise TypeError(f"{self!r} is not plain data: it cannot be compared")

    __ne__ = __eq__

    def __repr__(self):
        return f"<the program's {object.__getattribute__(self, '_where')[2]} object>"


def entry_points(job):
    """The functions the assert tests test (named by the row, even like builtins), as a tuple."""
    names = job.get("entry_points")
    names = [names] if isinstance(names, str) else names or []
    return tuple(n for n in names if isinstance(n, str) and n.isidentifier())


def _names(job):
    """Every name the assertion tests and their set-up read."""
    names = set()
    for source in [job.get("setup") or ""] + [t["code"] for t in job["tests"] if t["type"] == "assert"]:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _holds_remote(value, depth=0):
    """Whether a value the tests keep is (or contains, a few levels down) a handle into the program's process."""
    if isinstance(value, Remote):
        return True
    if depth < 3 and type(value) in (list, tuple, set, frozenset):
        return any(_holds_remote(v, depth + 1) for v in value)
    if depth < 3 and type(value) is dict:
        return any(_holds_remote(v, depth + 1) for v in value.values())
    return False


def _program_error(name, reply):
    """The program's exception, as the builtin exception of its class's name (so that a test's
    ``except TypeError`` sees a TypeError), else a RuntimeError; the message kept."""
    kind = getattr(builtins, reply.get("type") or "", None)
    # StopIteration would silently end a map()/filter() in the test (PEP 479 makes it a RuntimeError too)
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, (StopIteration,
                                                                                        StopAsyncIteration)):
        try:
            return kind(reply.get("message", ""))
        except Exception:  # a class that wants other arguments (UnicodeDecodeError)
            pass
    return RuntimeError(f"{name} raised {reply['error']}")


def proxied_names(job):
    """``(referenced, needed)``. Referenced: names the assertion tests and their set-up read that are not
    builtins, and the entry points: the only names a program's function may stand in for (a program defining
    ``set`` or ``abs`` must not replace the test's own, but a program's ``max`` is what tests with the entry
    point ``max`` test). Needed: the entry points the tests read by name, one of which a program must define
    (else a builtin or the set-up would stand in for it); none when the tests reach it otherwise
    (``Solution().add``)."""
    read, entries = _names(job), entry_points(job)
    return read - set(dir(builtins)) | set(entries), tuple(name for name in entries if name in read)


def _run_test(worker, test, job, namespace_box):
    """One test's outcome: an observation for the host to compare (call, stdio) or a verdict (assert)."""
    timeout = job["limits"]["test_timeout_s"]
    kind = test["type"]
    if kind == "stdio":
        worker.ensure("__main__")
        reply = worker.ask({"op": "stdio", "input": test["input"]}, worker.until(timeout))
        error = reply.get("error")
        return {"stdout": reply.get("stdout", ""), "error": None if error is None else str(error)[:300],
                "truncated": reply.get("truncated") is True}
    worker.ensure("solution")
    if kind == "call":
        reply = worker.ask({"op": "call", "fn": test["fn"], "args": test["args"], "kwargs": test.get("kwargs", {"dict": []})},
                           worker.until(timeout))
        # kept as its JSON text: the host parses one test's value at a time (see REPLY_BYTES)
        if "value" in reply:
            return {"value_json": json.dumps(reply["value"])}
        return {"error": str(reply.get("error", "no value"))[:300]}
    needed = namespace_box["needed"]
    if needed and not set(needed) & set(worker.names):  # else a builtin (or the set-up) would stand in for it
        return {"passed": False, "error": "NameError: the program defines no "
                + " or ".join(repr(name) for name in needed)}
    if namespace_box.get("names") != (worker.names, worker.generation):  # an assert: run here, with proxies
        # (a new program process: the set-up runs again, so that no handle it made points into the old one)
        namespace = {"__name__": "tests"}
        for name in set(worker.names) & namespace_box["referenced"]:
            namespace[name] = _proxy(worker, name, timeout)
        exec(compile(job.get("setup") or "", "<setup>", "exec"), namespace)  # after the proxies: its names win
        namespace_box.update(names=(worker.names, worker.generation), namespace=namespace)
    worker.fault, worker.alarm_at = None, worker.until(timeout)
    signal.setitimer(signal.ITIMER_REAL, max(worker.alarm_at - time.monotonic(), 0.001))
    try:
        exec(compile(test["code"], "<test>", "exec"), namespace_box["namespace"])
        verdict = {"passed": True}
    except AssertionError as err:
        verdict = {"passed": False, "error": f"AssertionError: {err}"[:300]}
    except Exception as err:  # the test's own code failed, or a program's exception it did not expect
        verdict = {"passed": False, "error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        worker.alarm_at = None
        worker.holds_objects = any(_holds_remote(v) for v in list(namespace_box["namespace"].values()))
    if worker.fault is not None:  # a timeout or a dead worker that the test's code swallowed
        raise worker.fault
    return verdict


def judge(job_fd, result_fd):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a program (same uid) that signals the judge changes nothing
    job = json.loads(_read_all(job_fd))
    os.close(job_fd)
    token = job.pop("token")
    deadline = job["deadline"]  # the host's, on the shared monotonic clock
    _confine(job, result_fd)
    filtered = _refuse_unbounded_memory()
    if filtered:  # (its workers add the refusal of new sessions, after starting their own)
        global _NO_SESSIONS
        _NO_SESSIONS = _no_new_sessions()
    send(result_fd, {"confined": True, "seccomp": filtered})

    # stop early enough that the results reach the host before its own deadline
    worker, results = Worker(job, deadline - min(0.5, job["limits"]["timeout_s"] / 10)), []

    def _alarm(signum, frame):
        """The test's own deadline only: a SIGALRM that the program (same uid) sends early is ignored."""
        if worker.alarm_at is None:
            return
        left = worker.alarm_at - time.monotonic()
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        raise worker.timed_out()

    signal.signal(signal.SIGALRM, _alarm)
    try:
        referenced, needed = proxied_names(job)
        box = {"referenced": referenced, "needed": needed}
    except SyntaxError as err:
        box = {"referenced": set(), "broken": f"the tests do not parse: {err}"}
    kept = 0  # bytes of the observations kept (VERDICT_BYTES)
    for test in job["tests"]:
        if time.monotonic() >= worker.deadline:
            results.append({"error": "timeout"})
            continue
        if kept > VERDICT_BYTES:
            results.append({"error": f"the program's replies exceed {VERDICT_BYTES >> 20} MiB in all"})
            continue
        try:
            if "broken" in box:
                raise JudgeError(box["broken"])
            results.append(_run_test(worker, test, job, box))
        except JudgeTimeout:
            worker.stop()
            results.append({"error": "timeout"})
        except WorkerGone as err:
            results.append({"error": str(err)[:300]})
        except JudgeError as err:
            results.append({"error": f"judge: {err}"[:300]})
        except Exception as err:  # the tests' set-up failed
            results.append({"passed": False, "error": f"{type(err).__name__}: {err}"[:300]})
        kept += len(json.dumps(results[-1]))
    worker.stop()
    worker.memory.close()
    send(result_fd, {"token": token, "results": results})


class JudgeError(Exception):
    """The judge itself could not run a test (not the program's fault)."""


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


# ---------------------------------------------------------------- worker: the program under test


def worker(recv_fd, send_fd):
    import io

    namespace = {}
    objects = []  # what the tests hold handles to (see Remote)
    output_cap = 1 << 20
    while True:
        try:
            request = receive(recv_fd)
        except EOFError:
            os._exit(0)
        op, raw = request["op"], None  # raw: a stdio test's output, sent after its reply as bytes (never parsed)
        try:
            if op == "load":
                output_cap = request.get("output_cap", output_cap)
                compiled = compile(request["code"], "<solution>", "exec")
                namespace = {"__name__": request["name"], "__builtins__": __builtins__}
                objects = []
                if request["name"] != "__main__":
                    exec(compiled, namespace)
                # a builtin under its own name (max = max, from builtins import max) is not the program's function
                names = [k for k, v in namespace.items()
                         if callable(v) and not k.startswith("__") and v is not getattr(builtins, k, None)]
                reply = {"names": names}
            elif op == "call":
                args, kwargs = decode(request["args"], objects), decode(request["kwargs"], objects)
                if "handle" in request:
                    fn = objects[request["handle"]]
                else:
                    fn = _function(namespace, request["fn"])
                if fn is None:
                    reply = {"error": f"NameError: the program defines no {request['fn']!r}"}
                else:
                    reply = _value(fn(*args, **kwargs), objects if request.get("handles") else None)
            elif op == "attr":
                reply = _value(getattr(objects[request["handle"]], request["name"]), objects)
            elif op == "setattr":
                setattr(objects[request["handle"]], request["name"], decode(request["value"], objects))
                reply = {"value": None}
            elif op == "next":
                try:
                    item = next(objects[request["handle"]])
                except StopIteration:
                    reply = {"done": True}
                else:
                    reply = _value(item, objects)
            elif op == "special":
                target, args = objects[request["handle"]], decode(request["args"], objects)
                reply = _value(SPECIAL[request["name"]](target, *args), objects)
            elif op == "stdio":
                reply = _stdio(compiled, request["input"], output_cap, io)
                raw = reply.pop("stdout")
                reply["stdout_bytes"] = len(raw)
            else:
                reply = {"error": f"unknown request {op!r}"}
        except BaseException as err:  # noqa: B036 - the program's exceptions (SystemExit included) are its answer
            # the nearest builtin class: a subclass of ValueError is a ValueError to the test (a program's own class
            # named ValueError is not)
            kind = next((k.__name__ for k in type(err).__mro__ if getattr(builtins, k.__name__, None) is k), "")
            reply, raw = {"error": f"{type(err).__name__}: {err}"[:300], "type": kind[:100],
                          "message": str(err)[:300]}, None
        send(send_fd, reply)
        if raw is not None:
            _write_all(send_fd, raw)


SPECIAL = {"bool": lambda o: bool(o) is True, "len": len, "iter": iter, "getitem": lambda o, k: o[k],
           "str": str}  # what a test may ask of an object it holds a handle to


def _value(value, objects):
    """A reply with ``value`` as plain data; else, where the asker takes handles (``objects`` given), one to it."""
    try:
        return {"value": encode(plain(value))}
    except TypeError:
        if objects is None:
            raise
        objects.append(value)
        return {"handle": len(objects) - 1, "type": type(value).__name__[:100]}


def _function(namespace, name):
    """A top-level function, else a method of ``Solution()`` (LeetCode-style problems, as in LiveCodeBench)."""
    fn = namespace.get(name)
    if callable(fn):
        return fn
    solution = namespace.get("Solution")
    if isinstance(solution, type) and callable(getattr(solution, name, None)):
        return getattr(solution(), name)
    return None


def _stdio(compiled, text, cap, io):
    """Runs the program as a script with ``text`` on fd 0 and fd 1 captured in a file of the sandbox's /tmp."""
    with open(".stdin", "w") as f:
        f.write(text)
    saved_in, saved_out = os.dup(0), os.dup(1)
    inp, out = os.open(".stdin", os.O_RDONLY), os.open(".stdout", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(inp, 0)
    os.dup2(out, 1)
    old = sys.stdin, sys.stdout
    sys.stdin = io.TextIOWrapper(io.FileIO(0, closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    error = None
    try:
        exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as err:
        if err.code not in (None, 0):
            error = f"SystemExit: {err.code}"
    except BaseException as err:  # noqa: B036
        error = f"{type(err).__name__}: {err}"[:300]
    finally:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        sys.stdin, sys.stdout = old
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        for fd in (saved_in, saved_out, inp):
            os.close(fd)
    os.lseek(out, 0, 0)
    data = os.read(out, cap + 1)
    os.close(out)
    return {"stdout": data[:cap], "truncated": len(data) > cap, "error": error}  # (bytes: sent as a raw frame)


if __name__ == "__main__":
    if sys.argv[1] == "judge":
        judge(int(sys.argv[2]), int(sys.argv[3]))
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past its size limit: an error, not a kill
        worker(int(sys.argv[2]), int(sys.argv[3]))
