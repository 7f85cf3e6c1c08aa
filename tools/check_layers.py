#!/usr/bin/env python3
"""Check kvsieve's import rule on a checkout (docs/architecture.md, "Import rule").

Areas, lowest first: kernels <- metadata <- sparse <- selectors <- integrations <- eval.
A module may import from its own area and from areas below it, never above: integrations may
import every core area, and nothing in the core imports integrations; eval sits on top.
Backends (kvsieve/sparse/backends) never import selectors. No import cycles: the modules of
kvsieve, linked by every import they write (function-level ones too; ``from a import b`` links to
``a.b`` when that is a module, else to ``a``), form no cycle.

Usage: check_layers.py [REPO_ROOT]   (default: current directory)
Exit status 0 when the rule holds, 1 with one line per violation otherwise.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ORDER = ["kernels", "metadata", "sparse", "selectors", "integrations", "eval"]


def area_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "kvsieve":
        return None
    return parts[1] if parts[1] in ORDER else None


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
    edges: dict[str, set[str]] = {}
    for path in files:
        rel = path.relative_to(root)
        module = _module_name(rel)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        imports = imported_modules(path, package)
        for _, target, names in imports:
            linked = {f"{target}.{n}" for n in names if f"{target}.{n}" in modules}
            if len(linked) < len(names) or not names:
                linked.add(target)
            edges.setdefault(module, set()).update(t for t in linked if t in modules and t != module)
        own = area_of(module)
        if own is None:
            continue
        in_backends = module.startswith("kvsieve.sparse.backends")
        for lineno, target, _ in imports:
            other = area_of(target)
            if other is None:
                continue
            if ORDER.index(other) > ORDER.index(own):
                problems.append(f"{rel}:{lineno}: {own} imports {target} ({other} is above {own})")
            if in_backends and other == "selectors":
                problems.append(f"{rel}:{lineno}: a backend imports a selector ({target})")
    problems += [f"import cycle among: {', '.join(cycle)}" for cycle in import_cycles(edges)]
    for line in sorted(set(problems)):
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
