"""The house's shape, read from the source's imports (every ``import`` and ``from ... import`` of ``scgrpo``, at
module level or inside a function): which layer each room belongs to, that no import runs from a room up to a
higher layer, and that no modules import each other in a circle.

A new room (a module or package directly under ``src/scgrpo``) must be placed in :data:`LAYERS` before it can land.
"""

from __future__ import annotations

import ast
import os
from typing import Optional

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

LAYERS = [
    # 0: leaves, nothing of the package below them
    {"errors", "lightning_internals", "chat", "lora_fused", "packing"},
    # 1: infrastructure: ranks, memory errors, files written whole, run folders, the 4-bit LoRA layer
    {"distributed", "oom", "atomic_io", "runs", "lora4bit"},
    # 2: the engines and checkers a step uses: sampling, model loading, verifiers, decision marks, checkpoint state
    {"rollout", "models", "verifiers", "pivots", "run_state"},
    # 3: what a task and an objective are, the memory budget, evaluation, the model card
    {"envs", "objectives", "budget", "evaluation", "model_card"},
    # 4: data: prompt sources (tasks, files, environments' rows) and the verified buffer
    {"data"},
    # 5: the step's parts: forward passes, the self-teacher, the update
    {"policy", "selfteacher", "update"},
    # 6: the step's stages and bookkeeping: the rollout stage, the divergence guard and the step's metrics
    {"stage", "guard", "step_log"},
    # 7: Lightning callbacks
    {"callbacks"},
    # 8: the LightningModule
    {"module"},
    # 9: entry points: the CLI and the package's face
    {"cli", "scgrpo"},
]
"""Rooms from the bottom up; a room may import its own layer's rooms and any below"""


def modules() -> dict[str, str]:
    """Module name -> file, for every module of the package (a package as its ``__init__``)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(SRC, "scgrpo")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


def imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the deepest module each import names)."""
    mods = modules()

    def resolve(name: str) -> Optional[str]:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = resolve(name) if name.split(".")[0] == "scgrpo" else None
                if target and target != module:
                    edges[module].add(target)
    return edges


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "scgrpo"


def layer_of(name: str) -> int:
    return next(k for k, rooms in enumerate(LAYERS) if name in rooms)


def test_every_room_has_a_layer():
    placed = set().union(*LAYERS)
    missing = sorted({room(m) for m in modules()} - placed)
    assert not missing, f"rooms without a layer (add each to tests/test_architecture.py's LAYERS): {missing}"
    gone = sorted(placed - {room(m) for m in modules()})
    assert not gone, f"LAYERS names rooms the package no longer has: {gone}"


def test_no_import_runs_up_a_layer():
    up = sorted(f"{a} (layer {layer_of(room(a))}) imports {b} (layer {layer_of(room(b))})"
                for a, targets in imports().items() for b in targets
                if room(a) != room(b) and layer_of(room(b)) > layer_of(room(a)))
    assert not up, "imports that run up:\n" + "\n".join(up)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_modules_import_each_other_in_a_circle():
    assert circles(imports()) == []


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The reading itself: a package where a lower room imports a higher one, and two modules import each other
    (one of them inside a function), is caught by both checks."""
    package = tmp_path / "scgrpo"
    (package / "rollout").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rollout" / "__init__.py").write_text("")
    (package / "errors.py").write_text("from scgrpo.module import RLVRModule\n")  # layer 0 -> layer 8
    (package / "module.py").write_text("RLVRModule = object\n")
    (package / "rollout" / "a.py").write_text("from scgrpo.rollout.b import g\n\ndef f():\n    return g\n")
    (package / "rollout" / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", str(tmp_path))
    edges = imports()
    assert edges["scgrpo.errors"] == {"scgrpo.module"}
    assert edges["scgrpo.rollout.b"] == {"scgrpo.rollout.a"} and edges["scgrpo.rollout.a"] == {"scgrpo.rollout.b"}
    assert circles(edges) == [["scgrpo.rollout.a", "scgrpo.rollout.b"]]
    assert layer_of(room("scgrpo.module")) > layer_of(room("scgrpo.errors"))


# ------------------------------------------------------------------------------------------------------ sizes
MAX_FILE_LINES = 600
"""No file of the package is longer, but those in :data:`OVERSIZE`"""
OVERSIZE = {
    "scgrpo.verifiers.sandbox_harness": "the sandbox runs the file's text alone (python -c, in a new root where the "
                                        "package is not importable): the judge, the worker and their codec are one file",
}
MAX_MODULE_LINES = 400
"""``module.py``, the LightningModule's file"""
MAX_CLASS_LINES = 350
"""The ``RLVRModule`` class, from ``class`` to its last line"""
MAX_METHOD_LINES = 40
"""An ``RLVRModule`` method's body, from its first statement after the docstring to its last line (the signature,
which lists the YAML options, and the docstring are not counted)"""


def body_lines(function: ast.FunctionDef) -> int:
    """Lines of ``function``'s body after its docstring."""
    body = function.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def file_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return len(f.read().splitlines())


def size_faults(mods: dict[str, str]) -> list[str]:
    faults = [f"{name}: {file_lines(path)} lines (at most {MAX_FILE_LINES})" for name, path in sorted(mods.items())
              if name not in OVERSIZE and file_lines(path) > MAX_FILE_LINES]
    if "scgrpo.module" in mods:
        path = mods["scgrpo.module"]
        if file_lines(path) > MAX_MODULE_LINES:
            faults.append(f"scgrpo.module: {file_lines(path)} lines (at most {MAX_MODULE_LINES})")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "RLVRModule":
                if node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                    faults.append(f"RLVRModule: {node.end_lineno - node.lineno + 1} lines (at most {MAX_CLASS_LINES})")
                faults += [f"RLVRModule.{f.name}: {body_lines(f)} lines (at most {MAX_METHOD_LINES})"
                           for f in node.body if isinstance(f, ast.FunctionDef) and body_lines(f) > MAX_METHOD_LINES]
    return faults


def test_no_file_class_or_method_outgrows_its_limit():
    assert size_faults(modules()) == []


def test_the_files_over_the_limit_say_why():
    mods = modules()
    for name, why in OVERSIZE.items():
        with open(mods[name], encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        assert "Why one file of this length" in doc, f"{name}'s docstring must say why it is one long file ({why})"


# ------------------------------------------------------------------------------------------ module-level state
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray"}
"""Calls that make a mutable container"""
STATEFUL = {"Lock", "RLock", "Condition", "Event", "Semaphore", "Queue", "SimpleQueue", "ContextVar",
            "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local"}
"""Calls that make an object whose whole point is state shared between callers"""
MUTATORS = {"append", "extend", "insert", "add", "update", "pop", "popitem", "clear", "remove", "discard",
            "setdefault", "put", "put_nowait", "get_nowait", "appendleft", "extendleft", "sort", "reverse"}
NOT_IMPORTED = {"scgrpo.verifiers.sandbox_harness"}
"""Modules the package never imports: the harness is a program of its own, run inside the sandbox (its globals are
the sandboxed process's)"""


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _mutable(value: ast.AST) -> str:
    """"state" for an object made to be shared state, "container" for a mutable container, else ""."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return "container"
    name = _call_name(value)
    return "state" if name in STATEFUL else "container" if name in CONTAINERS else ""


def _bindings(body: list[ast.stmt]) -> list[tuple[str, ast.AST, int]]:
    found = []
    for node in body:
        if isinstance(node, ast.Assign):
            found += [(t.id, node.value, node.lineno) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            found.append((node.target.id, node.value, node.lineno))
    return found


def _is_constant_name(name: str) -> bool:
    return name.strip("_").isupper() or name == "__all__"


def state_faults(mods: dict[str, str]) -> list[str]:
    """Module-level and class-level mutable state anywhere in the package: a ``global`` statement; a name bound at
    module or class level to a lock, queue, context variable or weak mapping; a container bound there to a name that
    is not a constant's (UPPER_CASE); a constant container mutated (subscript assigned or deleted, a mutating method
    called on it) anywhere in the package; a module attribute of the package assigned from another module, or a class
    attribute assigned through its class (state every instance shares). A memo of a function of its arguments
    (``functools.cache``: a device's stream or nf4 table, a capability probe) is not state: it never changes what the
    function returns. Nor is a number bound once at module level that no package code rebinds (the tuning constants
    that tests and benchmarks set for a comparison, ``packing.PACK_WIDTH``, ``four_bit.STREAM_KERNEL``); switches that
    the step reads are its objects' settings (:class:`~scgrpo.policy.PassOptions`).

    What it cannot see: state behind a call it does not know (``_POOL = SomeClass()`` at module level), bindings
    inside a module-level ``if`` or ``try``, a memo that returns a mutable object, writes through ``setattr`` or
    ``__setitem__``. Review catches those; this test keeps the common forms out."""
    trees = {}
    for name, path in mods.items():
        if name not in NOT_IMPORTED:
            with open(path, encoding="utf-8") as f:
                trees[name] = ast.parse(f.read(), path)
    faults, constants = [], set()
    for name, tree in trees.items():
        scopes = [("", tree.body)] + [(f"{n.name}.", n.body) for n in tree.body if isinstance(n, ast.ClassDef)]
        for prefix, body in scopes:
            for target, value, line in _bindings(body):
                kind = _mutable(value)
                if kind == "state":
                    faults.append(f"{name}:{line}: {prefix}{target} is shared state ({_call_name(value)})")
                elif kind == "container" and not _is_constant_name(target):
                    faults.append(f"{name}:{line}: {prefix}{target} is a mutable {type(value).__name__.lower()} "
                                  "at module or class level")
                elif kind == "container":
                    constants.add(target)
        modules_imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                            for a in n.names if a.name.startswith("scgrpo")}
        modules_imported |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                             and (n.module or "").startswith("scgrpo") for a in n.names
                             if f"{n.module}.{a.name}" in mods}
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                faults.append(f"{name}:{node.lineno}: global {', '.join(node.names)}")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in modules_imported | classes:
                    faults.append(f"{name}:{node.lineno}: assigns {target.value.id}.{target.attr}")
    for name, tree in trees.items():
        for node in ast.walk(tree):
            subject = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for target in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                    if isinstance(target, ast.Subscript):
                        subject = target.value
                    elif isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):  # TABLE |= {...}
                        subject = target
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                subject = node.func.value
            label = subject.id if isinstance(subject, ast.Name) else subject.attr if isinstance(
                subject, ast.Attribute) else None
            if label in constants:
                faults.append(f"{name}:{node.lineno}: mutates the constant {label}")
    return faults


def test_no_module_level_mutable_state():
    assert state_faults(modules()) == []


def test_the_state_check_sees_each_kind(tmp_path, monkeypatch):
    """The reading itself, on a planted package: a module-level cache, a lock, a class-level list, a constant table
    written to, a switch flipped from another module, a class attribute set through its class and a ``global`` are
    each found; a constant table only read and a memo are not."""
    package = tmp_path / "scgrpo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "import functools\nimport threading\n\n_cache = {}\n_lock = threading.Lock()\nTABLE = {'x': 1}\nREAD = (1, 2)\n"
        "SWITCH = True\n\n\nclass C:\n    seen = []\n    NAMES = {'a'}\n\n\ndef f(k):\n    global SWITCH\n"
        "    TABLE[k] = 2\n    C.warned = True\n    return READ[0]\n\n\n@functools.cache\ndef memo(k):\n    return k\n\n\n"
        "def h():\n    global TABLE\n    TABLE |= {'y': 3}\n")
    (package / "b.py").write_text("from scgrpo import a\n\n\ndef g():\n    a.SWITCH = False\n    return a.C.NAMES\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", str(tmp_path))
    faults = state_faults(modules())
    expected = ["scgrpo.a:4: _cache", "scgrpo.a:5: _lock is shared state", "scgrpo.a:12: C.seen",
                "scgrpo.a:18: mutates the constant TABLE", "scgrpo.b:5: assigns a.SWITCH", "scgrpo.a:17: global SWITCH",
                "scgrpo.a:19: assigns C.warned", "scgrpo.a:29: global TABLE", "scgrpo.a:30: mutates the constant TABLE"]
    assert len(faults) == len(expected), faults
    for want in expected:
        assert any(f.startswith(want) for f in faults), (want, faults)


def test_the_size_check_counts_a_method_past_its_docstring(tmp_path, monkeypatch):
    package = tmp_path / "scgrpo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_METHOD_LINES + 1))
    (package / "module.py").write_text(f'class RLVRModule:\n    def step(self):\n        """Doc."""\n{body}\n\n'
                                       f'    def short(self):\n        """Doc.\n\n        More."""\n        return 1\n')
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", str(tmp_path))
    assert size_faults(modules()) == [f"RLVRModule.step: {MAX_METHOD_LINES + 1} lines (at most {MAX_METHOD_LINES})"]
