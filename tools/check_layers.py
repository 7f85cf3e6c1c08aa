#!/usr/bin/env python3
"""Check kvsieve's import rule on a checkout (docs/architecture.md, "Import rule").

Areas, lowest first: kernels <- metadata <- sparse <- selectors <- integrations <- eval.
A module may import from its own area and from areas below it, never above: integrations may
import every core area, and nothing in the core imports integrations; eval sits on top.
Backends (kvsieve/sparse/backends) never import selectors.

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


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the importing package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    pkg_root = root / "kvsieve"
    if not pkg_root.is_dir():
        print(f"no kvsieve/ package under {root}")
        return 1
    problems: list[str] = []
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        if package.endswith(".__init__"):
            package = package[: -len(".__init__")]
        own = area_of(module)
        if own is None:
            continue
        in_backends = module.startswith("kvsieve.sparse.backends")
        for lineno, target in imported_modules(path, package):
            other = area_of(target)
            if other is None:
                continue
            if ORDER.index(other) > ORDER.index(own):
                problems.append(f"{rel}:{lineno}: {own} imports {target} ({other} is above {own})")
            if in_backends and other == "selectors":
                problems.append(f"{rel}:{lineno}: a backend imports a selector ({target})")
    for line in sorted(set(problems)):
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
