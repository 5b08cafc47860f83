"""The docs stay true where a check can tell: docs/architecture.md names every module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _named(text: str) -> set[str]:
    """The paths a doc names in backquotes, ``{a,b}`` groups expanded."""
    named = set()
    for path in re.findall(r"`([\w./{},-]+\.py)`", text):
        group = re.search(r"\{([^}]*)\}", path)
        options = group.group(1).split(",") if group else [""]
        named.update(path.replace(group.group(0), option) if group else path for option in options)
    return named


def test_the_architecture_doc_names_every_module():
    modules = {str(path.relative_to(ROOT)) for folder in ("model", "storage", "actors", "cluster")
               for path in (ROOT / folder).rglob("*.py")
               if path.name != "__init__.py" or path.parent.name == "training"}
    named = _named((ROOT / "docs" / "architecture.md").read_text())
    assert sorted(modules - named) == []
    assert sorted(name for name in named - modules if not (ROOT / name).exists()) == []
