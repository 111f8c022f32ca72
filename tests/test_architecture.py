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
    # 6: the step's bookkeeping: the divergence guard and the step's metrics
    {"guard", "step_log"},
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
