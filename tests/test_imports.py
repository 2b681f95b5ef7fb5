"""The package's import graph runs one way: no circle between modules or folders, the core below every rule.

Read with `ast`, so imports inside functions count too: a function-level import that only hides a circle is a circle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each installed package lives in the repository (setup.py's package_dir).
PACKAGES = {"hf_prefixflow": ROOT / "hf_prefixflow", "hf_prefixflow.trainers": ROOT / "trainers"}
# Folders from the bottom up: a module may import from its own folder or one below it, never from one above.
FLOORS = ["hf_prefixflow._compat", "hf_prefixflow.errors", "hf_prefixflow.config", "hf_prefixflow.core",
          "hf_prefixflow.models", "hf_prefixflow.planning", "hf_prefixflow.apply", "hf_prefixflow.distributed",
          "hf_prefixflow.trainers", "hf_prefixflow"]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module of ours that `name` imports anywhere in its file (the longest known name of each import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, else a name of `base`
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def lazy_imports(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    # The package root loads the trainers on first use (PEP 562 `__getattr__`), an arrow down from the front door.
    return {name: {t for t in targets if not (name == "hf_prefixflow" and t.startswith("hf_prefixflow.trainers"))}
            for name, targets in edges.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of `edges` as a list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def floor(name: str) -> int:
    matches = [i for i, prefix in enumerate(FLOORS) if name == prefix or name.startswith(prefix + ".")]
    return max(matches, key=lambda i: len(FLOORS[i]))


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((name, target) for name, targets in edges.items() for target in targets
                  if floor(target) > floor(name))


def test_no_module_circle():
    assert cycle(lazy_imports(graph())) is None, cycle(lazy_imports(graph()))


def test_no_folder_circle_and_no_upward_arrow():
    edges = lazy_imports(graph())
    folders: dict[str, set[str]] = {}
    for name, targets in edges.items():
        folders.setdefault(FLOORS[floor(name)], set()).update(FLOORS[floor(t)] for t in targets)
    for name in folders:
        folders[name].discard(name)
    assert cycle(folders) is None, cycle(folders)
    assert upward(edges) == []


def test_every_module_has_a_floor():
    assert all(floor(name) >= 0 for name in modules())


def test_core_imports_no_rule():
    """The scheduler, cache and attention never reach a parallel rule, a model adapter or a trainer."""
    above = ("hf_prefixflow.distributed", "hf_prefixflow.trainers", "hf_prefixflow.models", "hf_prefixflow.planning")
    edges = graph()
    crossing = sorted((name, t) for name, targets in edges.items() if name.startswith("hf_prefixflow.core")
                      for t in targets if t.startswith(above))
    assert crossing == []


@pytest.mark.parametrize("broken", ["circle", "upward"])
def test_the_checks_catch_a_broken_graph(broken):
    """Broken variants: an added circle, and an arrow from the core up to a trainer, are each found."""
    edges = lazy_imports(graph())
    if broken == "circle":
        edges["hf_prefixflow.core.access"] = edges["hf_prefixflow.core.access"] | {"hf_prefixflow.core.scheduler"}
        assert cycle(edges) is not None
    else:
        edges["hf_prefixflow.core.waves"] = edges["hf_prefixflow.core.waves"] | {"hf_prefixflow.trainers.mixin"}
        assert upward(edges) == [("hf_prefixflow.core.waves", "hf_prefixflow.trainers.mixin")]
