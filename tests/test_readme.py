"""Every ```python block of README.md runs as written, each in a fresh namespace, in order; and
README.md and docs/ point at nothing outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def test_block_extraction_finds_what_is_there():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]


_README_BLOCKS = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_python_blocks():
    assert _README_BLOCKS, "README.md has no ```python block"


@pytest.mark.parametrize("index", range(len(_README_BLOCKS)))
def test_readme_python_block_runs(index, capsys):
    """Each block runs and prints something; every kernel path it prints (``'phase': 'path'``) is
    named in the block's own text, so the README names the path that really runs."""
    code = compile(_README_BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": f"readme_block_{index + 1}"})
    out = capsys.readouterr().out
    assert out.strip(), f"README.md python block {index + 1} prints nothing"
    for path in re.findall(r"'(?:context|generation)': '(\w+)'", out):
        assert f"'{path}'" in _README_BLOCKS[index], f"block {index + 1} runs path {path!r} but does not name it"


def test_no_links_outside_the_repository():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\.\./shared|DESIGN\b|/work/", line):
                bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_docs_index_lists_every_page():
    """docs/index.md links every reference page and every results page."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in sorted((ROOT / "docs").rglob("*.md"))
             if p.name != "index.md"]
    missing = [p for p in pages if f"]({p})" not in index]
    assert not missing, f"docs/index.md does not list {missing}"
