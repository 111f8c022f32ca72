"""Bounds the code sandbox should hold beyond the resource limits of ``test_code_attacks.py``: what a program can make
the kernel, the judge and the trainer hold, what it can reach through a bound folder, and what it leaves behind.

Each test runs one attack program (the attack first, then the right answer, as in ``test_code_attacks.py``) and
measures from outside what it cost or reached:

- kernel memory (:func:`kernel_bytes`): the machine's memory that is neither free, nor on the LRU lists (page
  cache, the processes' anonymous pages and tmpfs pages, which ``memory_mb`` and ``disk_mb`` already bound), nor
  free pages waiting on the per-CPU lists; read from ``/proc/meminfo`` and ``/proc/zoneinfo`` every 20 ms. It counts
  slab (IPC objects, inodes and dentries), large kmallocs, vmalloc, page tables and socket buffers. Its growth while
  the program runs must stay within ``memory_mb`` + :data:`SLACK_MB` (the sandbox's own kernel structures and the
  noise of a shared machine), plus, for sockets, what sockets of the default size may queue;
- the judge's peak resident memory, and this process's (the trainer's: its high-water mark reset first);
- a Unix socket the test listens on, a folder closed to others, the IPC tables and the folders every user can write.

The classes: SysV message queues and semaphores; tmpfs inodes; socket buffers enlarged through io_uring (whose
requests seccomp does not see); TCP autotuning on the loopback of bubblewrap's network namespace; replies that are
expensive to decode; a Unix socket under a bound folder; parent folders recreated more open than on the host; what
the ``process`` mode leaves behind. Each test's docstring gives what its attack got on the sandbox as it was when the
test was written (a 2-core machine, Linux 6.18, root, 24 GiB, net.core.wmem_max 4 MiB). The namespaced modes run
where they work (``bwrap`` where bubblewrap is installed, ``namespaces`` as root); the ``process`` test runs as root,
in a mount namespace of its own where the folder that closes this Python to other users is opened (its program
needs a uid of its own).
"""

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from scgrpo.verifiers import PythonTests
from scgrpo.verifiers import sandbox as sandbox_module
from scgrpo.verifiers.sandbox import UID_BASE, UID_SPAN, result_value, sysv_objects
from tests.verifiers.modes import skip_unless
from tests.verifiers.servers import answering


MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
SLACK_MB = 256
"""Kernel memory the sandbox itself may add beside ``memory_mb`` (its processes' page tables, stacks and namespaces,
a few MiB each) and the noise of other work on the machine (within +-35 MiB over a minute here)"""
MARK = b"The two processes inside the code sandbox"  # on the judge's and the worker's command lines
NAMESPACED = ["bwrap", "namespaces"]
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")


def _call(expected, fn="solve"):
    return {"type": "call", "fn": fn, "args": [], "expected": expected}


def _score(mode, program, tests, binds=(), cgroup=True, **limits):
    """The program's result in ``mode``; ``cgroup`` False: without a memory cgroup, as on a host that gives none,
    so that the refusals and the other bounds alone must hold."""
    verifier = PythonTests(isolation=mode, workers=1, **limits)
    verifier.sandbox.binds.extend(binds)
    if not cgroup:
        verifier.sandbox.cgroup_base = None
    result = verifier.verify_batch([f"```python\n{program}```"], [tests], ["q"])[0]
    assert not isinstance(result, Exception), result
    return result


# ---------------------------------------------------------------- measuring from outside


def _meminfo():
    with open("/proc/meminfo") as f:
        return {key: int(value.split()[0]) * 1024 for key, value in (line.split(":", 1) for line in f)}


def _per_cpu_free_pages():
    """Free pages on the per-CPU lists (``/proc/zoneinfo``'s ``count:`` lines): not in MemFree, yet free (a freed
    socket buffer lands there first: hundreds of MiB of them drain over seconds)."""
    pages = 0
    with open("/proc/zoneinfo") as f:
        for line in f:
            fields = line.split()
            if fields[:1] == ["count:"]:
                pages += int(fields[1])
    return pages


def kernel_bytes():
    """Memory the kernel holds for itself: neither free nor on an LRU list (what processes map and tmpfs holds)."""
    info = _meminfo()
    return (info["MemTotal"] - info["MemFree"] - info["Active"] - info["Inactive"] - info.get("Unevictable", 0)
            - _per_cpu_free_pages() * PAGE)


def _sandbox_processes():
    """``(pid, argv)`` of the sandbox's processes: a sandbox uid, or the harness on the command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if UID_BASE <= uid < UID_BASE + UID_SPAN or any(MARK in arg for arg in argv):
            found.append((int(pid), argv))
    return found


def _status_bytes(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _quiet_kernel_bytes(wait_s=15.0):
    """:func:`kernel_bytes` once it holds still (within 16 MiB over half a second): what an earlier sandbox held is
    freed after it ends (a namespace's IPC objects, a tmpfs's inodes), and a start taken meanwhile would hide the
    next program's growth behind that fall."""
    deadline, recent = time.monotonic() + wait_s, [kernel_bytes()]
    while time.monotonic() < deadline:
        time.sleep(0.1)
        recent = (recent + [kernel_bytes()])[-6:]
        if len(recent) == 6 and max(recent) - min(recent) < 16 * MiB:
            break
    return recent[-1]


class Watch:
    """Samples, every 20 ms in a thread, the growth of :func:`kernel_bytes` since the start (``peak["kernel"]``) and
    the largest value of each probe (a function returning bytes, a count or None)."""

    def __init__(self, **probes):
        self.probes = probes
        self.peak = dict.fromkeys(["kernel", *probes], 0)
        self.base = _quiet_kernel_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        self.peak["kernel"] = max(self.peak["kernel"], kernel_bytes() - self.base)
        for name, probe in self.probes.items():
            try:
                value = probe()
            except OSError:
                value = None
            if value is not None:
                self.peak[name] = max(self.peak[name], value)

    def _run(self):
        while not self._stop.wait(0.02):
            self.sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()

    def settled(self, within=64 * MiB, wait_s=10.0):
        """Kernel memory's growth once it has fallen back within ``within`` of the start (or after ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            grown = kernel_bytes() - self.base
            if grown <= within or time.monotonic() > deadline:
                return grown
            time.sleep(0.1)


def _mib(n):
    return f"{n / MiB:.0f} MiB"


# ---------------------------------------------------------------- 1. SysV message queues and semaphore sets

IPC = """import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
# each start of the program's process adds 96 semaphore sets of 32000 (2 MiB of kernel memory each) and 4096 message
# queues holding two messages of msgmax (8 KiB): 256 MiB a start, which the sandbox's IPC namespace keeps when the
# process is replaced; six starts, 1.5 GiB, at most
try:
    with open("/proc/sysvipc/sem") as f:
        sets = len(f.readlines()) - 1
except OSError:
    sets = 0
if sets < 6 * 96:
    for _ in range(96):
        if libc.semget(0, 32000, 0o1600) < 0:
            break
    message = ctypes.create_string_buffer(8 + 8192)
    message[0] = 1
    for _ in range(4096):
        queue = libc.msgget(0, 0o1600)
        if queue < 0:
            break
        libc.msgsnd(queue, message, 8192, 0o4000)
        libc.msgsnd(queue, message, 8192, 0o4000)
def solve():
    t = time.process_time()
    while time.process_time() - t < 0.25:  # past the 0.2 s of CPU after which the next test gets a fresh process
        pass
    return 1
"""
def _ipc_objects():
    """``(table, id, uid)`` of the host IPC namespace's SysV objects whose owner or creator is a sandbox uid."""
    return [(table, key, owners[0]) for table, key, owners in sysv_objects()
            if any(UID_BASE <= u < UID_BASE + UID_SPAN for u in owners)]


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no_cgroup"])
@pytest.mark.parametrize("mode", NAMESPACED)
def test_sysv_message_queues_and_semaphores_are_bounded_and_gone_after_scoring(mode, cgroup):
    """A program whose every start makes 96 semaphore sets of 32000 (``semget``) and 4096 message queues of 16 KiB
    (``msgget`` and ``msgsnd``), its process replaced before each of 6 tests: the objects outlive each process in the
    sandbox's IPC namespace, and no limit counts them (only shared memory is refused). Kernel memory must stay
    within ``memory_mb`` (128) + :data:`SLACK_MB`, and nothing may remain once it is scored. Written against a
    sandbox where the kernel's memory grew 1.5 GiB (1546 MiB, both modes, all 6 tests passed), freed only when the
    namespace died."""
    skip_unless(mode)
    with Watch() as watch:
        result = _score(mode, IPC, [_call(1)] * 6, cgroup=cgroup, memory_mb=128, test_timeout_s=5.0, timeout_s=30.0,
                        cpu_s=5)
    bound = (128 + SLACK_MB) * MiB
    assert watch.peak["kernel"] <= bound, (
        f"the kernel held {_mib(watch.peak['kernel'])} more for the program's IPC objects (bound {_mib(bound)}); "
        f"{result.info['tests']}")
    assert watch.settled() <= 64 * MiB, "kernel memory the program's IPC objects held did not come back"
    assert _ipc_objects() == []


# ---------------------------------------------------------------- 2. tmpfs inodes

INODES = """import os
# empty files: none holds a page of /tmp's size, each an inode and a dentry (about 1 KiB of slab); a million at most
made = 0
try:
    while made < 1_000_000:
        os.mknod(f"f{made}")
        made += 1
except OSError:
    pass
def solve():
    return 1
"""


def _sandbox_tmp_inodes():
    """Inodes in use on the sandbox's /tmp, seen through a sandbox process's root (None before there is one)."""
    host_tmp = os.stat("/tmp").st_dev
    used = None
    for pid, _ in _sandbox_processes():
        try:
            if os.stat(f"/proc/{pid}/root/tmp").st_dev == host_tmp:  # (bubblewrap's outer process: the host's)
                continue
            fs = os.statvfs(f"/proc/{pid}/root/tmp")
        except OSError:
            continue
        used = max(used or 0, fs.f_files - fs.f_ffree)
    return used


@pytest.mark.parametrize("mode", NAMESPACED)
def test_tmpfs_inodes_are_bounded(mode):
    """A program makes up to a million empty files (``mknod``) in its /tmp of ``disk_mb`` 16: none uses a page of the
    size, each holds an inode and a dentry in the kernel. Making files must be refused well before that (at most 65536
    inodes in use: the sandbox's /tmp, read through a sandbox process's ``/proc/<pid>/root``), or their kernel memory
    stay within ``memory_mb`` (128) + :data:`SLACK_MB`. Written against a sandbox where all 1,000,000 were made (of a
    tmpfs default of 3,085,448 inodes) and the kernel held 1.0 GiB more (997 to 999 MiB, both modes)."""
    skip_unless(mode)
    with Watch(inodes=_sandbox_tmp_inodes) as watch:
        result = _score(mode, INODES, [_call(1)], memory_mb=128, disk_mb=16, test_timeout_s=15.0, timeout_s=20.0,
                        cpu_s=15)
    bound = (128 + SLACK_MB) * MiB
    inodes, held = watch.peak["inodes"], watch.peak["kernel"]
    assert 0 < inodes <= 65536 or held <= bound, (  # (0: the sandbox's /tmp not seen from here, the memory decides)
        f"{inodes} inodes in a 16 MiB /tmp held {_mib(held)} of kernel memory (bound {_mib(bound)}); "
        f"{result.info['tests']}")


# ---------------------------------------------------------------- 3. socket buffers enlarged through io_uring

IO_URING = """import ctypes, mmap, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SETUP, ENTER = 425, 426  # io_uring_setup, io_uring_enter (the same numbers on x86_64 and aarch64)
def ring():
    '''An io_uring of 8 entries, its rings mapped here (None where it is refused)'''
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(SETUP, 8, params)
    if fd < 0:
        return None
    sq_entries, cq_entries = struct.unpack_from("<II", params.raw, 0)
    sq = struct.unpack_from("<7I", params.raw, 40)  # head, tail, ring_mask, ring_entries, flags, dropped, array
    cq = struct.unpack_from("<6I", params.raw, 80)  # head, tail, ring_mask, ring_entries, overflow, cqes
    size = max(sq[6] + 4 * sq_entries, cq[5] + 16 * cq_entries)
    rings = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
    entries = mmap.mmap(fd, 64 * sq_entries, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0x10000000)
    return fd, sq, cq, rings, entries
def setsockopt(uring, fd, level, name, value):
    '''setsockopt as an io_uring request (IORING_OP_URING_CMD, SOCKET_URING_OP_SETSOCKOPT): no syscall of its own'''
    ring_fd, sq, cq, rings, entries = uring
    optval = ctypes.c_int(value)
    sqe = bytearray(64)
    struct.pack_into("<BBHiI", sqe, 0, 46, 0, 0, fd, 3)
    struct.pack_into("<II", sqe, 16, level, name)
    struct.pack_into("<I", sqe, 44, 4)
    struct.pack_into("<Q", sqe, 48, ctypes.addressof(optval))
    tail = struct.unpack_from("<I", rings, sq[1])[0]
    index = tail & struct.unpack_from("<I", rings, sq[2])[0]
    entries[64 * index:64 * index + 64] = bytes(sqe)
    struct.pack_into("<I", rings, sq[6] + 4 * index, index)
    struct.pack_into("<I", rings, sq[1], tail + 1)
    if libc.syscall(ENTER, ring_fd, 1, 1, 1, None, 0) < 0:  # submit one, wait for one
        return -ctypes.get_errno()
    head = struct.unpack_from("<I", rings, cq[0])[0]
    mask = struct.unpack_from("<I", rings, cq[2])[0]
    result = struct.unpack_from("<i", rings, cq[5] + 16 * (head & mask) + 8)[0]
    struct.pack_into("<I", rings, cq[0], head + 1)
    return result
# socket pairs whose both ends get SO_SNDBUF of twice net.core.wmem_max, filled both ways: 1.75 GiB at most
uring, pairs, queued, chunk = ring(), [], 0, b"x" * (1 << 16)
for _ in range(120):
    try:
        pairs.append(socket.socketpair())
    except OSError:
        break
    for end in pairs[-1]:
        if uring is not None:
            setsockopt(uring, end.fileno(), 1, 7, 64 << 20)
        end.setblocking(False)
        try:
            while queued < 1792 << 20:
                queued += end.send(chunk)
        except OSError:
            pass
def solve():
    return 1
"""


def _sysctl(name):
    with open(f"/proc/sys/{name.replace('.', '/')}") as f:
        return int(f.read().split()[0])


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no_cgroup"])
@pytest.mark.parametrize("mode", NAMESPACED)
def test_socket_buffers_enlarged_through_io_uring_are_bounded(mode, cgroup):
    """``setsockopt`` of SO_SNDBUF (and SO_RCVBUF and their FORCE forms) is refused by seccomp, but the same request
    sent through io_uring (``IORING_OP_URING_CMD`` with ``SOCKET_URING_OP_SETSOCKOPT``, Linux 6.7+) is run by the
    kernel without a syscall the filter sees. One process (``open_files`` 256) enlarges both ends of up to 120 socket
    pairs to twice net.core.wmem_max and fills them. Bound: ``memory_mb`` (128) + :data:`SLACK_MB` + what sockets of
    the default size may queue (``open_files`` x ``processes`` x net.core.wmem_default: 256 x 4 x 208 KiB = 208 MiB
    here, the allowance docs/verifiers.md gives socket pairs). Written against a sandbox where the kernel held
    1.8 GiB more (1827 to 1835 MiB, both modes: 8 MiB a socket; in one process of the default 64 open files,
    408 MiB). Other paths measured in one process of 64 files: pipes enlarged with F_SETPIPE_SZ 28 MiB (1 MiB a pipe,
    64 MiB a uid), default socket pairs 12 MiB, Unix datagram pairs 4 MiB; TCP on loopback: see the next test."""
    skip_unless(mode)
    with Watch() as watch:
        result = _score(mode, IO_URING, [_call(1)], cgroup=cgroup, memory_mb=128, open_files=256, processes=4,
                        test_timeout_s=10.0, timeout_s=15.0, cpu_s=10)
    allowance = 256 * 4 * _sysctl("net.core.wmem_default")
    bound = (128 + SLACK_MB) * MiB + allowance
    assert watch.peak["kernel"] <= bound, (
        f"the kernel held {_mib(watch.peak['kernel'])} more in socket buffers (bound {_mib(bound)}: 128 + "
        f"{SLACK_MB} MiB + {_mib(allowance)} of default-size sockets); {result.info['tests']}")


# ---------------------------------------------------------------- 4. TCP autotuning on loopback

TCP_LOOPBACK = """import socket, time
# a listener and 60 connections on the loopback of the sandbox's network namespace; both ends send and read for a
# second (autotuning then grows each receive buffer towards net.ipv4.tcp_rmem's maximum), then only send: what is
# queued stays in the kernel, 1 GiB at most (the program's own count)
pairs, sent, received, chunk = [], 0, 0, b"x" * (1 << 16)
try:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    for _ in range(60):
        a = socket.create_connection(server.getsockname(), timeout=1)
        b, _ = server.accept()
        a.setblocking(False)
        b.setblocking(False)
        pairs.append((a, b))
except OSError:
    pass
def pump(read):
    global sent, received
    moved = 0
    for pair in pairs:
        for end in pair:
            try:
                while sent - received < 1 << 30:
                    n = end.send(chunk)
                    sent, moved = sent + n, moved + n
            except OSError:
                pass
            while read:
                try:
                    n = len(end.recv(1 << 20))
                except OSError:
                    break
                if not n:
                    break
                received += n
    return moved
start = time.monotonic()
while pairs and time.monotonic() - start < 1.0:
    pump(read=True)
idle = 0
while pairs and time.monotonic() - start < 4.0 and idle < 20:
    idle = 0 if pump(read=False) else idle + 1
    time.sleep(0.01)
def solve():
    return 1
"""


def _tcp_bytes():
    """TCP's memory as the kernel counts it (``/proc/net/sockstat``'s ``mem``, in pages: one count for all network
    namespaces)."""
    with open("/proc/net/sockstat") as f:
        for line in f:
            fields = line.split()
            if fields[:1] == ["TCP:"] and "mem" in fields:
                return int(fields[fields.index("mem") + 1]) * PAGE
    return None


def test_loopback_tcp_is_refused_or_bounded():
    """bubblewrap's network namespace has its loopback up (the ``namespaces`` mode's is down: connecting there fails
    with ENETUNREACH, so only ``bwrap`` applies). A program (``open_files`` 128) opens a TCP listener and 60
    connections on 127.0.0.1, lets autotuning grow their buffers (towards net.ipv4.tcp_rmem's 32 MiB and tcp_wmem's
    4 MiB here, which a new network namespace copies from the host's), then fills them both ways. Loopback TCP must be
    refused (``socket`` of AF_INET or AF_INET6 failing) or its memory, the larger of the kernel memory's growth and
    TCP's own count, stay within ``memory_mb`` (128) + :data:`SLACK_MB` + what default-size sockets may queue
    (128 x 4 x net.core.wmem_default). Written against a sandbox where TCP's count grew 1.0 to 1.1 GiB (1039 to
    1131 MiB in 5 runs: the program's 1 GiB cap) and the kernel memory as much (1037 to 1084 MiB); 28 connections of
    the default 64 open files queued 706 to 890 MiB."""
    skip_unless("bwrap")
    base = _tcp_bytes() or 0
    with Watch(tcp=_tcp_bytes) as watch:
        result = _score("bwrap", TCP_LOOPBACK, [_call(1)], memory_mb=128, open_files=128, processes=4,
                        test_timeout_s=10.0, timeout_s=15.0, cpu_s=10)
    tcp = watch.peak["tcp"] - base
    held = max(watch.peak["kernel"], tcp)
    bound = (128 + SLACK_MB) * MiB + 128 * 4 * _sysctl("net.core.wmem_default")
    assert held <= bound, (f"loopback TCP queued {_mib(tcp)} by TCP's count, the kernel held "
                           f"{_mib(watch.peak['kernel'])} more (bound {_mib(bound)}); {result.info['tests']}")


# ---------------------------------------------------------------- 5. replies expensive for the judge to decode

JUDGE = """import os, struct, sys
# the worker's replies, forged: {forged} (5 bytes of JSON an item, a string or list object of 56 bytes and its
# pointer once decoded), {size} MiB a message
harness = sys.modules["__main__"]
items = ({size} << 20) // 5 - 64
reply = {reply}
frame = struct.pack(">I", len(reply)) + reply
real_send = harness.send
def forged(fd, message):
    if {key!r} not in message:
        return real_send(fd, message)
    view = memoryview(frame)
    while view:
        view = view[os.write(fd, view):]
harness.send = forged
def solve():
    return {{"ab"}}
print("ab")
"""
FORGED = {  # what the forged reply is, the key of the replies it replaces, its JSON, and the tests it answers
    "value": ("the right value, {'ab'}, as a set of 1.7 million equal strings", "value",
              """b'{"value": {"set": [' + b'"ab",' * items + b'"ab"]}}'""", "call"),
    "error": ("a call's error as a list of a million empty lists", "value",
              """b'{"error": [' + b'[],' * items + b'[]]}'""", "call"),
    "stdout": ("a stdio test's output as a list of a million empty lists", "stdout_bytes",
               """b'{"stdout": [' + b'[],' * items + b'[]], "stdout_bytes": 0}'""", "stdio"),
}
JUDGE_PEAK_MB = 256
"""What the judge may hold at its peak: the interpreter, a few replies of a capped size, its results"""


def _judge_peak():
    """The largest resident high-water mark of a judge (the harness run with ``judge``) alive now."""
    peak = None
    for pid, argv in _sandbox_processes():
        if b"judge" in argv[-4:]:
            try:
                peak = max(peak or 0, _status_bytes(pid, "VmHWM"))
            except OSError:
                pass
    return peak


@pytest.mark.parametrize("size", [1, 8])
@pytest.mark.parametrize("forged", list(FORGED))
@pytest.mark.parametrize("mode", NAMESPACED)
def test_replies_that_are_expensive_to_decode_cost_the_judge_and_the_trainer_little(mode, forged, size):
    """The worker's replies are the program's to write (it replaces the harness's ``send``). Each forged reply
    (:data:`FORGED`: a value, a call's error, a stdio output spelt as lists) is parametrized at 1 MiB (under the
    judge's cap on a reply: it is read, and must cost the judge and the trainer little, whatever it scores) and at
    8 MiB (past it). At first: 4 call tests answered with the right value, {"ab"}, spelt as 8 MiB of JSON (a set of
    1.7 million equal strings), some
    100 MiB of objects once decoded. The judge keeps every reply's value until the last test, then sends them all to
    the host (40 MiB, under its 64 MiB cap), which decodes them whole. The program must score 0 with a reason (a reply
    over a size cap, say: not "pass" or "wrong"), the judge's peak resident memory stay under :data:`JUDGE_PEAK_MB`,
    and this process's (the trainer's) grow by at most 100 MiB. Written against a sandbox where it scored 1.0 (all 4
    passed), the judge peaked at 562 MiB and this process grew by 499 to 540 MiB (both modes; a dict of repeated pairs
    instead, ``[0, []]``, took the judge to 1.1 GiB and this process up 1.05 GiB in 5 tests, but some 30 s: the host
    reads the answer 64 KiB at a time into a growing ``bytes``, 15 s of CPU for a 60 MiB answer)."""
    skip_unless(mode)
    with open("/proc/self/clear_refs", "w") as f:  # (5: the high-water mark of resident memory, reset)
        f.write("5")
    rss_before = _status_bytes("self", "VmRSS")
    what, key, reply, kind = FORGED[forged]
    program = JUDGE.format(forged=what, size=size, reply=reply, key=key)
    tests = [_call({"ab"}) if kind == "call" else {"type": "stdio", "input": "", "output": "ab\n"}] * 4
    with Watch(judge=_judge_peak) as watch:
        result = _score(mode, program, tests, memory_mb=256, test_timeout_s=5.0, timeout_s=30.0, cpu_s=5)
    grown = _status_bytes("self", "VmHWM") - rss_before
    seen = (f"score {result.score}, {result.info['tests']}; the judge peaked at {_mib(watch.peak['judge'])} "
            f"(bound {JUDGE_PEAK_MB} MiB), this process grew by {_mib(grown)} (bound 100 MiB)")
    if size > 1:  # past the judge's cap on a reply: no verdict from it (under the cap it is read, and costs little)
        assert result.score == 0.0 and not {"pass", "wrong"} & set(result.info["tests"]), seen
    assert watch.peak["judge"] <= JUDGE_PEAK_MB * MiB, seen
    assert grown <= 100 * MiB, seen


# ---------------------------------------------------------------- 6. a Unix socket under a bound folder

UNIX_SOCKET = """import socket
def solve():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect({path!r})
    return s.recv(100).decode()
"""


def _host_socket(kind):
    """(folder, path, socket): a Unix socket of ``kind`` bound at mode 0777 in a fresh folder of mode 0755."""
    folder = tempfile.mkdtemp(prefix="scgrpo-socket-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "service.sock")
    server = socket.socket(socket.AF_UNIX, kind)
    server.bind(path)
    os.chmod(path, 0o777)
    server.settimeout(0.1)
    return folder, path, server


@pytest.mark.parametrize("mode", NAMESPACED)
def test_a_unix_socket_under_a_bound_folder_is_out_of_reach(mode):
    """A server of the host listens on a Unix socket (mode 0777, as services' sockets often are) in a folder the
    sandbox binds read-only (as it binds the Python prefix). A read-only mount does not stop ``connect`` and a
    network namespace does not cover file-system sockets: a program that reads the server's secret through it would
    score 1. It must score 0, and the server see no connection. Written against a sandbox where it scored 1.0 and
    the server was connected to (both modes)."""
    skip_unless(mode)
    folder, path, server = _host_socket(socket.SOCK_STREAM)
    server.listen(4)
    try:
        with answering(server, b"socket-secret") as connections:
            result = _score(mode, UNIX_SOCKET.format(path=path), [_call("socket-secret")], binds=[folder])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert (result.score, len(connections)) == (0.0, 0), f"{result.info}; {len(connections)} connection(s) to it"


UNIX_DATAGRAM = """import socket
def solve():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.settimeout(2)
    a.sendmsg([b"hello"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, __import__("array").array("i", [a.fileno()]))], 0,
              {path!r})
    return b.recv(100).decode()
"""


@pytest.mark.parametrize("mode", NAMESPACED)
def test_a_datagram_socket_pair_cannot_send_to_a_socket_under_a_bound_folder(mode):
    """The same server as a datagram socket: ``socket()`` is refused, but a datagram socket pair can still
    ``sendmsg`` to a path, passing one of its ends; the server writes its secret into it. The program must score 0
    and the server receive nothing. Written against a sandbox where it scored 1.0 (both modes)."""
    skip_unless(mode)
    folder, path, server = _host_socket(socket.SOCK_DGRAM)
    received, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                _, fds, _, _ = socket.recv_fds(server, 100, 4)
            except OSError:
                continue
            received.append(1)
            for fd in fds:
                with socket.socket(fileno=fd) as passed:
                    passed.send(b"socket-secret")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        result = _score(mode, UNIX_DATAGRAM.format(path=path), [_call("socket-secret")], binds=[folder])
    finally:
        stop.set()
        thread.join()
        server.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert (result.score, len(received)) == (0.0, 0), f"{result.info}; {len(received)} message(s) to it"


# ---------------------------------------------------------------- 6b. memory no process maps

UNMAPPED = """import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
def secret():
    # memfd_secret (447 on x86_64 and aarch64): a file of secret memory, mapped by no process once unmapped
    return int(libc.syscall(447, 0) >= 0)
def spliced():
    # vmsplice: a page of this process's memory into a pipe, where it stays pinned after the process unmaps it
    r, w = os.pipe()
    page = mmap.mmap(-1, 4096)
    page[:5] = b"hello"
    iov = (ctypes.c_void_p * 2)(ctypes.addressof(ctypes.c_char.from_buffer(page)), 4096)
    number = 278 if os.uname().machine == "x86_64" else 75
    return int(libc.syscall(number, w, iov, 1, 0) > 0)
"""


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no_cgroup"])
@pytest.mark.parametrize("mode", NAMESPACED)
def test_memory_no_process_maps_cannot_be_made(mode, cgroup):
    """Secret memory (``memfd_secret``) and pages spliced into a pipe (``vmsplice``) are held by no process's
    mapping, so where no cgroup counts them no watch sees them either: 768 MiB of secret memory and 896 MiB of huge
    pages pinned through pipes were held at ``memory_mb`` 128 without a cgroup. Both calls must fail. Written against
    a sandbox where both succeeded (both modes)."""
    skip_unless(mode)
    result = _score(mode, UNMAPPED, [_call(0, "secret"), _call(0, "spliced")], cgroup=cgroup)
    assert result.info["tests"] == ["pass", "pass"], result.info


# ---------------------------------------------------------------- 7. recreated parent folders

MODES_PROGRAM = """import os
def modes():
    return [os.stat(p).st_mode & 0o7777 for p in {paths!r}]
"""


@pytest.mark.parametrize("mode", NAMESPACED)
def test_recreated_parent_folders_are_no_more_open_than_on_the_host(mode):
    """The new root recreates the parents of each bound folder (those not bound themselves). Each must be no more open
    than the host's folder: no read, write or special bit the host's lacks (search bits may be added: they reach what
    is bound below, and nothing else is there). Checked for every parent of the sandbox's binds, among them a folder of
    mode 0700 holding a bound folder. Written against a sandbox that recreated every parent 0755: here ``/root``
    (0700 on the host, which holds this Python) and the test's folder (0700) were 0755 inside, listable by the
    program's uid, which on the host may not even look into them (both modes)."""
    skip_unless(mode)
    closed = tempfile.mkdtemp(prefix="scgrpo-closed-")  # (mode 0700)
    inner = os.path.join(closed, "bound")
    os.mkdir(inner, 0o755)
    try:
        verifier = PythonTests(isolation=mode, workers=1)
        sandbox = verifier.sandbox
        sandbox.binds.append(inner)
        binds = list(sandbox.binds)
        parents = sorted({p for b in binds for p in ["/", *_ancestors(b)]
                          if p != "/tmp" and not any(p == x or p.startswith(x.rstrip("/") + "/") for x in binds)})
        outcome = sandbox.run(MODES_PROGRAM.format(paths=parents), [{"type": "call", "fn": "modes", "args": []}])
        assert outcome.results is not None and "value_json" in outcome.results[0], outcome
        inside = dict(zip(parents, result_value(outcome.results[0])))
        host = {p: os.stat(p).st_mode & 0o7777 for p in parents}
    finally:
        shutil.rmtree(closed, ignore_errors=True)
    more_open = {p: (oct(host[p]), oct(inside[p])) for p in parents if inside[p] & ~(host[p] | 0o111)}
    assert closed in parents
    assert more_open == {}, f"(host mode, mode inside) of parents more open inside: {more_open}"


def _ancestors(path):
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


# ---------------------------------------------------------------- 8. what the process mode leaves behind

LEFTOVERS = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
queue = libc.msgget(0, 0o1600)  # in the host's IPC namespace (shared memory is refused by seccomp; these are not)
sems = libc.semget(0, 4, 0o1600)
for folder in ("/tmp", "/var/tmp", "/dev/shm"):
    try:
        with open(os.path.join(folder, "scgrpo-left-{tag}"), "w") as f:
            f.write("x")
    except OSError:
        pass
try:
    os.rename(os.getcwd(), "/tmp/scgrpo-moved-{tag}")  # the work folder, out from under the host's removal
except OSError:
    pass
def solve():
    return 1
"""
PROCESS_MODE = r'''
import ctypes, json, os, sys, tempfile
program = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
MS_BIND, MS_REC, MS_PRIVATE, CLONE_NEWNS, MNT_DETACH = 4096, 16384, 1 << 18, 0x20000, 2
exe, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
parts = exe.strip("/").split("/")
closed = next((p for p in ("/" + "/".join(parts[:i]) for i in range(1, len(parts))) if not os.stat(p).st_mode & 1),
              None)
if closed is not None:  # a mount namespace of this process's own, where that folder is a tmpfs holding only the Python
    assert prefix.startswith(closed + "/") and exe.startswith(prefix + "/"), (closed, prefix, exe)
    os.chdir("/")
    assert libc.unshare(CLONE_NEWNS) == 0 and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
    stage = tempfile.mkdtemp()
    assert libc.mount(prefix.encode(), stage.encode(), None, MS_BIND | MS_REC, None) == 0
    assert libc.mount(b"tmpfs", closed.encode(), b"tmpfs", 0, b"mode=755,size=1m") == 0
    os.makedirs(prefix, 0o755)
    assert libc.mount(stage.encode(), prefix.encode(), None, MS_BIND | MS_REC, None) == 0
    libc.umount2(stage.encode(), MNT_DETACH)
    os.rmdir(stage)
from scgrpo.verifiers.code import PythonTests
verifier = PythonTests(isolation="process", workers=1, memory_mb=256)
result = verifier.verify_batch(["```python\n" + program + "```"],
                               [[{"type": "call", "fn": "solve", "args": [], "expected": 1}]], ["q"])[0]
print(json.dumps({"score": result.score, "info": result.info}))
'''


def _shared_entries():
    """Entries at the top of the folders every user may write to that belong to a sandbox uid."""
    found = set()
    for folder in SHARED_FOLDERS:
        try:
            for entry in os.scandir(folder):
                try:
                    if UID_BASE <= entry.stat(follow_symlinks=False).st_uid < UID_BASE + UID_SPAN:
                        found.add(entry.path)
                except OSError:
                    pass
        except OSError:
            pass
    return found


def _remove(ipc, entries):
    libc = ctypes.CDLL(None, use_errno=True)
    for table, ident, _ in ipc:
        {"msg": lambda i: libc.msgctl(i, 0, None), "sem": lambda i: libc.semctl(i, 0, 0),
         "shm": lambda i: libc.shmctl(i, 0, None)}[table](ident)  # (IPC_RMID)
    for path in entries:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def test_the_process_mode_leaves_nothing_behind():
    """The ``process`` mode has no namespaces: its program (a uid of its own, as root) shares the host's IPC
    namespace and its /tmp, /var/tmp and /dev/shm. It makes a message queue and a semaphore set, a file in each of
    those folders, and renames its work folder (its own, in the sticky /tmp) away from where the host removes it.
    After scoring, no IPC object of a sandbox uid may remain, and no entry of one in those folders. Run in a
    subprocess that, where this Python lies under a folder closed to others (``/root`` here, which keeps the mode
    from working), opens it in a mount namespace of its own. Written against a sandbox that left a queue, a semaphore
    set, the three files and the moved work folder (and scored 1.0)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the process mode's program needs a uid of its own, the mount namespace root")
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    ipc_before = {(t, i) for t, i, _ in _ipc_objects()}
    entries_before = _shared_entries()

    def left():
        return [o for o in _ipc_objects() if o[:2] not in ipc_before], _shared_entries() - entries_before

    try:
        done = subprocess.run([sys.executable, "-c", PROCESS_MODE, LEFTOVERS.format(tag=tag)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        ipc, entries = left()
        if "no sandbox works here" in done.stderr:
            pytest.skip(done.stderr.strip().splitlines()[-1][-300:])
        assert done.returncode == 0, done.stderr[-3000:]
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
        assert outcome["info"]["sandbox"] == "process+uid", outcome
        assert (ipc, sorted(entries)) == ([], []), f"left: IPC objects {ipc}, in the shared folders {sorted(entries)}"
    finally:
        _remove(*left())


# ---------------------------------------------------------------- 9. what the program finds refused inside

PROBES = """import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def refused(call):
    try:
        call()
    except OSError as err:
        return errno.errorcode.get(err.errno, err.errno)
    return "allowed"
def key():
    if libc.syscall(248 if os.uname().machine == "x86_64" else 217, b"user", b"k", b"v", 1, -4) < 0:  # add_key
        raise OSError(ctypes.get_errno(), "add_key")
def mq():
    if libc.mq_open(b"/q", os.O_CREAT | os.O_RDWR, 0o600, None) < 0:
        raise OSError(ctypes.get_errno(), "mq_open")
def probe():
    return [os.statvfs("/tmp").f_files, refused(lambda: open("/x", "w")), refused(lambda: open("/dev/x", "w")),
            refused(key), refused(mq), refused(lambda: socket.socket(40, socket.SOCK_STREAM)),  # AF_VSOCK
            refused(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)), len(socket.socketpair())]
"""


def _key_users():
    with open("/proc/key-users") as f:
        return {int(line.split(":")[0]) for line in f if line.strip()}


@pytest.mark.parametrize("mode", NAMESPACED)
def test_inodes_capped_root_read_only_and_keys_queues_and_other_sockets_refused(mode):
    """Inside: /tmp holds ``disk_files`` inodes, the new root and /dev are not writable, kernel keys (a uid's
    keyring outlives its processes: unreclaimable slab for every fresh uid) and POSIX message queues are refused, and
    so is a socket of any family (vsock, netlink), while a socket pair still works; afterwards no key of a sandbox
    uid is left."""
    skip_unless(mode)
    before = _key_users()
    result = _score(mode, PROBES, [{"type": "call", "fn": "probe", "args": [],
                                    "expected": [1000, "EROFS", "EROFS", "EPERM", "EPERM", "EPERM", "EPERM", 2]}],
                    disk_files=1000)
    assert result.score == 1.0, result.info
    left = {uid for uid in _key_users() - before if UID_BASE <= uid < UID_BASE + UID_SPAN}
    assert not left, left


@pytest.mark.parametrize("mode", NAMESPACED)
def test_a_cgroup_the_kernel_will_not_make_leaves_the_program_to_the_watch_said_once(mode, caplog):
    """Out of cgroup ids (ENOSPC), say: the program still runs, under the address-space limit and the judge's watch,
    and the first such program says so once; a training run does not end on it."""
    skip_unless(mode)
    verifier = PythonTests(isolation=mode, workers=1)
    base = verifier.sandbox.cgroup_base
    if base is None:
        pytest.skip("no memory cgroup here")

    def refuse(name, limit):
        raise OSError(28, "No space left on device")

    verifier.sandbox.cgroup_base = type("Refusing", (), {"make": staticmethod(refuse), "path": base.path})()
    with caplog.at_level("WARNING", logger="scgrpo.verifiers.sandbox"):
        results = verifier.verify_batch(["```python\ndef solve():\n    return 1\n```"] * 2, [[_call(1)]] * 2, ["q"] * 2)
    assert [r.score for r in results] == [1.0, 1.0]
    said = [r.getMessage() for r in caplog.records if "cannot make a program's memory cgroup" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0]


NON_ROOT_PROBE = """import sys
from scgrpo.verifiers.sandbox import Sandbox
box = Sandbox("bwrap")
code = ('import os\\ndef f(x):\\n    return [os.statvfs("/tmp").f_files, os.statvfs("/dev/shm").f_files, '
        'open("/proc/self/status").read().split("CapEff:")[1].split()[0]]\\n')
out = box.run(code, [{"type": "call", "fn": "f", "args": [1]}])
print(box.describe(), out.results, out.failure)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("bwrap"),
                    reason="needs root, setpriv and bubblewrap (to run the sandbox as another user)")
def test_bubblewrap_without_root_caps_the_inodes_and_leaves_no_capability():
    """As a user without root (``nobody``), bubblewrap's tmpfs mounts take the inode caps too (the judge remounts
    them in bubblewrap's user namespace, then drops that capability): the program sees ``disk_files`` (4096) inodes
    on /tmp, 64 on /dev/shm, and no capability. Written against a sandbox where without root both had the tmpfs
    default (3,085,448 here) and a million files could be made. The sandbox's modules run from a copy others may
    read, under a Python others may run."""
    python = next((p for p in ("/usr/bin/python3", sys.executable) if subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", p, "-c", "pass"], cwd="/",
        capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip("no Python another user may run")
    copy = tempfile.mkdtemp(prefix="scgrpo-nonroot-")
    try:
        package = os.path.join(copy, "scgrpo", "verifiers")
        os.makedirs(package)
        here = os.path.dirname(sandbox_module.__file__)
        with open(os.path.join(here, "sandbox.py")) as f:
            if "mutmut" in f.read():  # (mutation testing's rewritten copy: it imports mutmut, which nobody's Python lacks)
                pytest.skip("the sandbox's modules are mutation testing's rewritten copy")
        for name in ("base.py", "cgroup.py", "sandbox.py", "sandbox_harness.py"):
            shutil.copy(os.path.join(here, name), package)
        for init in (os.path.join(copy, "scgrpo", "__init__.py"), os.path.join(package, "__init__.py")):
            open(init, "w").close()
        for folder, _, files in os.walk(copy):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                               NON_ROOT_PROBE], cwd="/", capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": copy})
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if ("bwrap sandbox" in done.stderr and "unavailable" in done.stderr) or "no sandbox" in done.stderr:
        pytest.skip(f"bubblewrap does not start without root here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split(maxsplit=1) == ["bwrap", "[{'value_json': '[4096, 64, \"0000000000000000\"]'}] None\n"]


@pytest.mark.parametrize("mode", NAMESPACED)
def test_each_program_leaves_no_cgroup_behind(mode):
    """Every program's cgroup is removed once it is scored: a normal end, a timeout and a program the judge ends for
    its memory leave nothing under the base (the sandbox's cgroups are named ``scgrpo-<hex>``)."""
    skip_unless(mode)
    verifier = PythonTests(isolation=mode, workers=1, timeout_s=3.0, test_timeout_s=1.0, memory_mb=128)
    base = verifier.sandbox.cgroup_base
    if base is None:
        pytest.skip("no memory cgroup here")

    def ours():
        return {n for n in os.listdir(base.path) if n.startswith("scgrpo-") and len(n) == len("scgrpo-") + 16}

    before = ours()
    programs = ["def solve():\n    return 1\n", "def solve():\n    while True:\n        pass\n",
                "def solve():\n    held = [bytearray(1 << 20) for _ in range(400)]\n    return 1\n"]
    results = verifier.verify_batch([f"```python\n{p}```" for p in programs], [_call(1)] * 3, ["q"] * 3)
    assert [r.score for r in results] == [1.0, 0.0, 0.0]
    assert ours() - before == set()
