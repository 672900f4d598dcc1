"""The demo model's training text: what every Python installation carries.

Documents are the language-reference topics of ``pydoc_data.topics`` plus the module, class and function
docstrings of the standard library, read with ``ast`` from the source files (never imported: importing every
stdlib module has side effects). Order is deterministic; every ``VAL_EVERY``-th document is held out.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

VAL_EVERY = 50
# Packages whose docstrings are tests, tooling or vendored code rather than library documentation.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "__pycache__"}
MIN_DOC_CHARS = 40


def pydoc_topics() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOC_CHARS:
                yield doc.strip()


def stdlib_docstrings(max_chars: int = 6_000_000) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_PARTS.intersection(path.relative_to(root).parts):
            continue
        for doc in _docstrings(path):
            docs.append(doc)
            total += len(doc)
            if total >= max_chars:
                return docs
    return docs


def documents(max_docstring_chars: int = 6_000_000) -> tuple[list[str], list[str]]:
    """(train, validation) documents."""
    docs = pydoc_topics() + stdlib_docstrings(max_docstring_chars)
    train = [d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1]
    return train, val
