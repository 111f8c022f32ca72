"""The sandbox's host side: where programs' memory cgroups are made (v1 and v2, from the files the kernel shows), a
cgroup's limit, joining it and emptying it, the folders made to hold the binds, and the clean-up of what a
``process``-mode program's uid leaves in the shared folders."""

import os
import subprocess
import sys
import time

import pytest

from scgrpo.verifiers import cgroup, sandbox

V1_CGROUP = "9:name=systemd:/\n4:memory:/jobs/trainer\n3:cpuset:/\n0::/\n"
V1_MOUNTS = ("30 25 0:27 / /sys/fs/cgroup/cpu rw,relatime shared:8 - cgroup cgroup rw,cpu\n"
             "33 25 0:30 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory\n")
V2_CGROUP = "0::/user.slice/trainer.scope\n"
V2_MOUNTS = "25 20 0:23 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_v1_memory_hierarchy_is_found_from_the_processes_cgroup_and_the_mounts(monkeypatch, tmp_path):
    made = []
    monkeypatch.setattr(cgroup, "_probe", lambda base: made.append(base) or None)
    mounts = V1_MOUNTS.replace("/sys/fs/cgroup/memory", str(tmp_path))
    base, why = cgroup.find_base(V1_CGROUP, mounts, root=str(tmp_path / "none"))
    assert why == "" and base == cgroup.CgroupBase(str(tmp_path / "jobs" / "trainer"), 1) and made == [base]


def test_the_v2_hierarchy_is_the_processes_own_cgroup_under_the_root(monkeypatch, tmp_path):
    monkeypatch.setattr(cgroup, "_probe", lambda base: None)
    base, why = cgroup.find_base(V2_CGROUP, V2_MOUNTS.replace("/sys/fs/cgroup", str(tmp_path)), root="/none")
    assert base == cgroup.CgroupBase(str(tmp_path / "user.slice" / "trainer.scope"), 2) and why == ""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")  # no cgroup2 line: the usual mount point
    base, _ = cgroup.find_base(V2_CGROUP, "", root=str(tmp_path))
    assert base == cgroup.CgroupBase(str(tmp_path / "user.slice" / "trainer.scope"), 2)


def test_a_containers_mount_shows_its_own_cgroup_at_the_mount_point(monkeypatch, tmp_path):
    monkeypatch.setattr(cgroup, "_probe", lambda base: None)
    mounts = f"33 25 0:30 /docker/abc {tmp_path} rw,relatime - cgroup cgroup rw,memory\n"
    base, _ = cgroup.find_base("4:memory:/docker/abc/job\n", mounts, root="/none")
    assert base == cgroup.CgroupBase(str(tmp_path / "job"), 1)
    base, _ = cgroup.find_base("4:memory:/docker/abc\n", mounts, root="/none")
    assert base.version == 1 and base.path.rstrip("/") == str(tmp_path)


def test_where_no_hierarchy_works_each_ones_reason_is_said(monkeypatch, tmp_path):
    monkeypatch.setattr(cgroup, "_probe", lambda base: f"refused v{base.version}")
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    mounts = V1_MOUNTS.replace("/sys/fs/cgroup/memory", str(tmp_path / "v1"))
    base, why = cgroup.find_base(V1_CGROUP.replace("0::/\n", "0::/x\n"), mounts, root=str(tmp_path))
    assert base is None and "cgroup v1 at" in why and "refused v1" in why and "refused v2" in why
    assert cgroup.find_base("0::/\n", "", root=str(tmp_path / "none")) == (None, "no memory cgroup is mounted here")


def test_a_v2_base_whose_memory_controller_is_not_delegated_is_refused_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")

    def write(folder, name, value, missing_ok=False):  # the kernel's answer where processes live in the base
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(cgroup, "_write", write)
    why = cgroup._probe(cgroup.CgroupBase(str(tmp_path), 2))
    assert why.startswith("the memory controller is not delegated to it (Device or resource busy; cgroup v2")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("scgrpo-probe")]


@pytest.mark.parametrize("version, files", [(1, {"memory.limit_in_bytes", "memory.memsw.limit_in_bytes",
                                                 "memory.kmem.tcp.limit_in_bytes"}),
                                            (2, {"memory.max", "memory.swap.max"})])
def test_a_programs_cgroup_holds_memory_and_swap_to_the_limit(version, files, tmp_path):
    folder = tmp_path / "g"
    base = cgroup.CgroupBase(str(tmp_path), version)
    original = os.mkdir

    def mkdir_with_files(path, *args):
        original(path, *args)
        for name in files | {"cgroup.procs"}:
            open(os.path.join(path, name), "w").close()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cgroup.os, "mkdir", mkdir_with_files)
        group = base.make("g", 123 << 20)
    written = {name: (folder / name).read_text() for name in files}
    expected = {name: str(123 << 20) for name in files}
    if version == 2:
        expected["memory.swap.max"] = "0"
    assert written == expected and group.path == str(folder) and group.version == version


def test_a_limit_the_kernel_refuses_removes_the_half_made_cgroup(tmp_path, monkeypatch):
    def write(folder, name, value, missing_ok=False):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(cgroup, "_write", write)
    with pytest.raises(OSError, match="Invalid argument"):
        cgroup.CgroupBase(str(tmp_path), 1).make("g", 1 << 20)
    assert not (tmp_path / "g").exists()


def test_the_command_joins_the_cgroup_before_it_becomes_the_program(tmp_path):
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    group = cgroup.ProgramCgroup(str(tmp_path), 1)
    done = subprocess.run(group.command([sys.executable, "-c", "import os; print(os.getpid())"]),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and procs.read_text().strip() == done.stdout.strip()  # the same process: exec


def test_peak_and_out_of_memory_kills_are_read_from_the_kernels_files(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "memory.max_usage_in_bytes").write_text("4096\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (v2 / "memory.peak").write_text("8192\n")
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    one, two = cgroup.ProgramCgroup(str(v1), 1), cgroup.ProgramCgroup(str(v2), 2)
    assert (one.peak_bytes(), one.out_of_memory_kills()) == (4096, 2)
    assert (two.peak_bytes(), two.out_of_memory_kills()) == (8192, 1)
    gone = cgroup.ProgramCgroup(str(tmp_path / "none"), 2)
    assert (gone.peak_bytes(), gone.out_of_memory_kills(), gone.pids()) == (None, 0, [])


def test_removing_kills_what_is_left_inside(tmp_path):
    folder = tmp_path / "g"
    folder.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (folder / "cgroup.procs").write_text(f"{child.pid}\n")
    removed, real_rmdir = [], os.rmdir

    def rmdir(path):  # (a cgroup's folder goes once it is empty; a plain one needs its files gone first)
        if child.poll() is None:
            raise OSError(16, "busy")
        os.unlink(os.path.join(path, "cgroup.procs"))
        real_rmdir(path)
        removed.append(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cgroup.os, "rmdir", rmdir)
        cgroup.ProgramCgroup(str(folder), 1).remove(timeout_s=10)
    assert child.wait(timeout=10) == -9 and removed == [str(folder)] and not folder.exists()


@pytest.mark.skipif(cgroup.find_base()[0] is None, reason="no memory cgroup can be made here")
def test_a_real_cgroup_stops_a_process_at_its_limit_and_is_removed():
    base, _ = cgroup.find_base()
    group = base.make(f"scgrpo-test-{os.getpid()}", 64 << 20)
    try:
        done = subprocess.run(group.command([sys.executable, "-c", "x = bytearray(256 << 20); print('held')"]),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "held" not in done.stdout  # (killed, or MemoryError under the limit)
        assert group.peak_bytes() is None or group.peak_bytes() <= 64 << 20
    finally:
        group.remove()
    assert not os.path.exists(group.path)


def test_the_folders_holding_the_binds_are_no_more_open_than_on_the_host(tmp_path):
    closed = tmp_path / "closed"
    (closed / "py").mkdir(parents=True)
    os.chmod(closed, 0o700)
    (tmp_path / "open").mkdir(0o777)
    os.chmod(tmp_path / "open", 0o777)
    (tmp_path / "open" / "lib").mkdir()
    modes = sandbox._parent_modes([str(closed / "py"), str(tmp_path / "open" / "lib")])
    assert modes[str(closed)] == 0o511  # search bits to reach the bind, nothing to list, nothing to write
    assert modes[str(tmp_path / "open")] == 0o555  # no write bit
    assert str(closed / "py") not in modes and "/tmp" not in modes


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of another uid)")
def test_the_clean_up_removes_what_the_uid_left_and_nothing_else(tmp_path, monkeypatch):
    uid = sandbox.UID_BASE + 12345
    shared = tmp_path / "shared"
    shared.mkdir()
    mine, theirs, folder = shared / "left.txt", shared / "root.txt", shared / "made"
    for path in (mine, theirs):
        path.write_text("x")
    folder.mkdir()
    (folder / "inner").write_text("x")
    outside = tmp_path / "outside"
    outside.write_text("keep")
    (shared / "link").symlink_to(outside)
    for path in (mine, folder, folder / "inner"):
        os.chown(path, uid, uid)
    os.lchown(shared / "link", uid, uid)
    sandbox._remove_leftovers(uid, [str(shared)])
    assert sorted(os.listdir(shared)) == ["root.txt"] and outside.read_text() == "keep"


def test_folders_other_users_may_write_to_are_found_below_the_shared_ones(tmp_path):
    top = tmp_path / "tmp"
    (top / "app" / ".X11-unix").mkdir(parents=True)
    (top / "closed").mkdir()
    (top / "deep" / "a" / "b" / "c").mkdir(parents=True)
    for path, mode in ((top, 0o1777), (top / "app", 0o755), (top / "app" / ".X11-unix", 0o1777),
                       (top / "deep" / "a" / "b" / "c", 0o777)):
        os.chmod(path, mode)
    (top / "link").symlink_to(tmp_path)  # (not followed)
    found = sandbox.writable_folders([str(top)], depth=2)
    assert found == sorted([str(top), str(top / "app" / ".X11-unix")])  # c lies 4 levels down: past depth 2
    assert str(top / "deep" / "a" / "b" / "c") in sandbox.writable_folders([str(top)], depth=4)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files and IPC objects of another uid)")
def test_the_clean_up_removes_the_uids_files_in_nested_shared_folders_and_its_ipc_objects(tmp_path):
    """Files a program's uid left in a folder every user may write to below /tmp (as /tmp/.X11-unix), and a SysV
    message queue it made (where no seccomp filter refused it): both gone after the clean-up, the others' kept."""
    uid = sandbox.UID_BASE + 23456
    nested = tmp_path / "shared" / ".X11-unix"
    nested.mkdir(parents=True)
    os.chmod(nested, 0o1777)
    (nested / "X0").write_text("root's")
    left = nested / "left"
    left.write_text("x")
    os.chown(left, uid, uid)
    python = "/usr/bin/python3"  # (one another uid may run: this venv's may lie in a folder closed to it)
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} for another uid to run")
    made = subprocess.run([python, "-c", "import ctypes; print(ctypes.CDLL(None).msgget(0, 0o600))"],
                          user=uid, group=uid, extra_groups=[], capture_output=True, text=True, timeout=30, cwd="/")
    queue = int(made.stdout)
    assert queue >= 0

    def queues():
        with open("/proc/sysvipc/msg") as f:
            return {int(row.split()[1]) for row in f.readlines()[1:]}

    assert queue in queues()
    sandbox._remove_leftovers(uid, sandbox.writable_folders([str(tmp_path / "shared")]))
    assert os.listdir(nested) == ["X0"] and queue not in queues()


def _memory_cgroups():
    with open("/proc/cgroups") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == "memory":
                return int(fields[2])
    return None


@pytest.mark.skipif(cgroup.find_base()[0] is None or _memory_cgroups() is None,
                    reason="no memory cgroup can be made here")
def test_a_removed_cgroup_whose_program_read_files_dies_at_once(tmp_path):
    """Page cache a program's reads charged to its cgroup pins the removed cgroup as a dying one (the kernel counts
    it in /proc/cgroups until the pages go; it has 65,535 ids): 8 programs that each read a file of their own, never
    cached before, leave the count where it was once removed. Written against a removal that left all 8 dying."""
    base, _ = cgroup.find_base()
    files = []
    for k in range(8):
        path = tmp_path / f"data{k}"
        path.write_bytes(os.urandom(1 << 20))
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # (not cached: the program's read charges it)
        files.append(str(path))
    before = _memory_cgroups()
    for k, path in enumerate(files):
        group = base.make(f"scgrpo-test-{os.getpid()}-{k}", 64 << 20)
        try:
            subprocess.run(group.command(["/bin/cat", path]), stdout=subprocess.DEVNULL, check=True, timeout=30)
        finally:
            group.remove()
    deadline = time.monotonic() + 5
    while _memory_cgroups() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _memory_cgroups() <= before + 2, (before, _memory_cgroups())
