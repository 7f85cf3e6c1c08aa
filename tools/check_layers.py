#!/usr/bin/env python3
"""Check kvsieve's import rule on a checkout (docs/architecture.md, "Import rule").

Areas by level, lowest first:

    base <- kernels <- metadata <- sparse <- selectors <- integrations <- {demo, gpu_check, eval} <- cli

``base`` is every top-level module other than ``cli`` and ``demo`` (``kvsieve/cache_dir.py``,
``kvsieve/terminal.py``): helpers that import nothing of kvsieve. ``demo``, ``gpu_check`` and
``eval`` are the applications over the library, side by side on one level; ``cli`` (the ``kvsieve``
command) dispatches to them. A module may import from its own area and from areas on lower levels,
never from a higher level nor from another area of its own level: integrations may import every
core area and nothing in the core imports integrations; no application imports another, and none
imports the command line. The package facade ``kvsieve/__init__.py`` has no area (its imports count
for cycles only). Backends (kvsieve/sparse/backends) never import selectors.

Imports by string count as imports: ``importlib.import_module("kvsieve.x")`` (a literal, or a
module-level name bound to one), a ``"kvsieve.x:attr"`` string (the entry-point notation of
dispatch tables and registries) and a ``"-m", "kvsieve.x"`` pair in a list or tuple (a child
process running a module) link to ``kvsieve.x`` when it is a module of the checkout.

No import cycles: the modules of kvsieve, linked by every import they write (function-level ones
too, and imports by string; ``from a import b`` links to ``a.b`` when that is a module, else to
``a``), form no cycle.

Usage: check_layers.py [REPO_ROOT]   (default: current directory)
Exit status 0 when the rule holds, 1 with one line per violation otherwise.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

#: areas by level, lowest first; the areas of one level never import each other
LEVELS = [["base"], ["kernels"], ["metadata"], ["sparse"], ["selectors"], ["integrations"],
          ["demo", "gpu_check", "eval"], ["cli"]]
LEVEL = {area: i for i, areas in enumerate(LEVELS) for area in areas}
#: ``"kvsieve.a.b:attr"``: a module and an attribute in the entry-point notation
ENTRY = re.compile(r"(kvsieve(?:\.\w+)+):\w+(?:\.\w+)*")


def area_of(module: str, top_modules: frozenset[str] = frozenset()) -> str | None:
    """The area of ``module``: ``kvsieve.<area>...``, or ``base`` for a top-level module of
    ``top_modules`` that is no area; ``None`` for the facade ``kvsieve`` and anything outside."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "kvsieve":
        return None
    if parts[1] in LEVEL:
        return parts[1]
    return "base" if parts[1] in top_modules else None


def imported_modules(path: Path, package: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``path`` (``names``: what ``from module import``
    takes, empty for ``import module``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the importing package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod, [alias.name for alias in node.names]))
    return found


def string_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import by string in ``path``: ``import_module(X)`` /
    ``__import__(X)`` with ``X`` a literal or a module-level name bound to one, a ``"-m", X`` pair
    in a list or tuple, and every ``"kvsieve.a.b:attr"`` literal (the module part)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
              for t in node.targets if isinstance(t, ast.Name)}

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return consts.get(node.id) if isinstance(node, ast.Name) else None

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            module = text(node.args[0]) if func in ("import_module", "__import__") else None
            if module is not None:
                found.append((node.lineno, module))
        elif isinstance(node, (ast.List, ast.Tuple)):
            found += [(b.lineno, text(b)) for a, b in zip(node.elts, node.elts[1:])
                      if text(a) == "-m" and text(b) is not None]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = ENTRY.fullmatch(node.value)
            if match:
                found.append((node.lineno, match.group(1)))
    return found


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    pkg_root = root / "kvsieve"
    if not pkg_root.is_dir():
        print(f"no kvsieve/ package under {root}")
        return 1
    problems: list[str] = []
    files = sorted(pkg_root.rglob("*.py"))
    modules = {_module_name(path.relative_to(root)) for path in files}
    top_modules = frozenset(path.stem for path in pkg_root.glob("*.py") if path.stem != "__init__")
    edges: dict[str, set[str]] = {}
    for path in files:
        rel = path.relative_to(root)
        module = _module_name(rel)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        imports = imported_modules(path, package)
        by_string = string_imports(path)
        for _, target, names in imports:
            linked = {f"{target}.{n}" for n in names if f"{target}.{n}" in modules}
            if len(linked) < len(names) or not names:
                linked.add(target)
            edges.setdefault(module, set()).update(t for t in linked if t in modules and t != module)
        edges.setdefault(module, set()).update(t for _, t in by_string if t in modules and t != module)
        own = area_of(module, top_modules)
        if own is None:
            if module != "kvsieve":
                problems.append(f"{rel}: in no area (place kvsieve/{module.split('.')[1]} in LEVELS of "
                                f"tools/check_layers.py)")
            continue
        in_backends = module.startswith("kvsieve.sparse.backends")
        for lineno, target, how in ([(n, t, "") for n, t, _ in imports]
                                    + [(n, t, " by string") for n, t in by_string]):
            other = area_of(target, top_modules)
            if other is None:
                continue
            if LEVEL[other] > LEVEL[own]:
                problems.append(f"{rel}:{lineno}: {own} imports {target}{how} ({other} is above {own})")
            elif LEVEL[other] == LEVEL[own] and other != own:
                problems.append(f"{rel}:{lineno}: {own} imports {target}{how} ({other} and {own} are side by "
                                "side: neither imports the other)")
            if in_backends and other == "selectors":
                problems.append(f"{rel}:{lineno}: a backend imports a selector ({target}{how})")
    problems += [f"import cycle among: {', '.join(cycle)}" for cycle in import_cycles(edges)]
    for line in sorted(set(problems)):
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
