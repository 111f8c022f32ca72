"""A memory cgroup per sandboxed program: one limit, enforced by the kernel, on everything the kernel charges to the
program's processes (their pages, and kernel memory: IPC objects, tmpfs inodes and pages, the page cache of the
files they write, their slab), the judge's own memory included.

The host makes the cgroup before the sandbox starts and runs the sandbox's first process through ``/bin/sh``, which
joins the cgroup and then ``exec``\\ s it, so that every process the sandbox starts is born inside. At the end every
process left in it is killed and the cgroup removed. cgroup v2 (``memory.max``, no swap) where the host delegates the
memory controller to the trainer's cgroup; cgroup v1 (``memory.limit_in_bytes``, the same for memory + swap, and
``memory.kmem.tcp.limit_in_bytes``, which v1 counts apart) where the memory hierarchy is mounted and writable.
Elsewhere (no cgroup file system, not root, no delegation) :func:`memory_cgroups` says why, and the sandbox keeps
its other bounds (see ``docs/verifiers.md``).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupBase:
    """Where programs' cgroups are made: a folder of the cgroup file system the trainer can create folders in."""

    path: str
    version: int  # 1 or 2

    def make(self, name: str, limit_bytes: int) -> "ProgramCgroup":
        """A fresh cgroup ``name`` under this base holding at most ``limit_bytes``. Raises OSError where the kernel
        refuses it (the caller then runs without one)."""
        path = os.path.join(self.path, name)
        os.mkdir(path)
        group = ProgramCgroup(path, self.version)
        try:
            if self.version == 2:
                _write(path, "memory.max", limit_bytes)
                _write(path, "memory.swap.max", 0, missing_ok=True)  # (no swap controller: nothing to bound)
            else:
                _write(path, "memory.limit_in_bytes", limit_bytes)
                _write(path, "memory.memsw.limit_in_bytes", limit_bytes, missing_ok=True)  # swap counts too
                _write(path, "memory.kmem.tcp.limit_in_bytes", limit_bytes, missing_ok=True)  # (v1 counts it apart)
        except OSError:
            group.remove()
            raise
        return group


class ProgramCgroup:
    """One program's cgroup (see the module docstring)."""

    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run from inside the cgroup: a shell joins it, then becomes ``argv``."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except OSError:
            return []

    def peak_bytes(self) -> Optional[int]:
        """The most the cgroup held at once, kernel memory included (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def out_of_memory_kills(self) -> int:
        """Processes the kernel killed for the cgroup's limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                fields = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
            return int(fields.get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kills every process left inside, then removes the cgroup (its charges go back to the parent)."""
        end = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if self.version == 2 and pids:
                _write(self.path, "cgroup.kill", 1, missing_ok=True)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not pids:
                self._reclaim()
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY or time.monotonic() > end:
                    raise
            time.sleep(0.01)


    def _reclaim(self) -> None:
        """Gives back the page cache still charged to the empty cgroup (the files its program read), so that the
        removed cgroup dies at once: one that page cache pins lingers as a dying cgroup, and the kernel has 65,535
        memory cgroup ids."""
        try:
            if self.version == 2:
                _write(self.path, "memory.reclaim", 1 << 40, missing_ok=True)
            else:
                _write(self.path, "memory.force_empty", 0, missing_ok=True)
        except OSError:  # (EAGAIN: not all of it could be reclaimed; the removal goes on)
            pass


def _write(folder: str, name: str, value: int, missing_ok: bool = False) -> None:
    try:
        with open(os.path.join(folder, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller (v1) or "" (v2): path}."""
    paths = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _mount(mountinfo: str, v2: bool) -> Optional[tuple[str, str]]:
    """(the cgroup path the mount shows at its root, its mount point) of the v1 memory hierarchy or of cgroup v2."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if (v2 and tail[0] == "cgroup2") or (not v2 and tail[0] == "cgroup" and "memory" in tail[2].split(",")):
            return fields[3], fields[4]
    return None


def _under(mount: tuple[str, str], own: str) -> str:
    """The folder of cgroup ``own`` under a mount whose root is cgroup ``mount[0]`` (a container's mount shows its
    own cgroup at the mount point: ``/docker/<id>`` mounted at ``/sys/fs/cgroup/memory``)."""
    root, point = mount
    relative = own[len(root):] if root != "/" and (own == root or own.startswith(root.rstrip("/") + "/")) else own
    return os.path.join(point, relative.lstrip("/"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def find_base(proc_cgroup: Optional[str] = None, mountinfo: Optional[str] = None,
              root: str = ROOT) -> tuple[Optional[CgroupBase], str]:
    """Where this process may make memory cgroups, and a line saying why not where it may not. Probes by making
    (and removing) one."""
    try:
        proc_cgroup = _read("/proc/self/cgroup") if proc_cgroup is None else proc_cgroup
        mountinfo = _read("/proc/self/mountinfo") if mountinfo is None else mountinfo
    except OSError as err:
        return None, f"cannot read this process's cgroups ({err})"
    own = _own_paths(proc_cgroup)
    candidates = []
    if "memory" in own and (mount := _mount(mountinfo, v2=False)):
        candidates.append(CgroupBase(_under(mount, own["memory"]), 1))
    if "" in own and (mount := _mount(mountinfo, v2=True) or (("/", root) if os.path.exists(
            os.path.join(root, "cgroup.controllers")) else None)):
        candidates.append(CgroupBase(_under(mount, own[""]), 2))
    if not candidates:
        return None, "no memory cgroup is mounted here"
    reasons = []
    for base in candidates:
        why = _probe(base)
        if why is None:
            return base, ""
        reasons.append(f"cgroup v{base.version} at {base.path}: {why}")
    return None, "; ".join(reasons)


def _probe(base: CgroupBase) -> Optional[str]:
    if base.version == 2:
        try:
            controls = _read(os.path.join(base.path, "cgroup.subtree_control")).split()
        except OSError as err:
            return f"unreadable ({err.strerror})"
        if "memory" not in controls:
            try:  # (refused where this cgroup holds processes itself and is not the root: v2 keeps them in leaves)
                _write(base.path, "cgroup.subtree_control", "+memory")
            except OSError as err:
                return (f"the memory controller is not delegated to it ({err.strerror}; cgroup v2 enables it only for a "
                        "cgroup that holds no processes itself, and this one holds the trainer: start the trainer in a "
                        "child of a delegated cgroup)")
    try:
        group = base.make(f"scgrpo-probe-{os.getpid()}-{time.monotonic_ns()}", 64 << 20)
    except OSError as err:
        return f"cannot make a cgroup in it ({err.strerror})"
    try:
        group.remove()
    except OSError as err:
        return f"cannot remove a cgroup made in it ({err.strerror})"
    return None
