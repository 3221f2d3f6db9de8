"""The README's layout section names every module of the daemon and the client package, in the row of its folder,
and names nothing that is not there: a module added, moved or removed without the README fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"server/kvbrokerd/": REPO / "server" / "kvbrokerd", "client/kvbroker/": REPO / "client" / "kvbroker"}
NAME = re.compile(r"`([A-Za-z0-9_]+(?:\.py|\.c|/))`")


def _section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Layout\n")
    return text[start : text.index("\n## ", start + 1)]


def _table(root: str) -> list[tuple[str, str]]:
    """(first cell, whole row) of each row of the table headed by `root`."""
    rows: list[tuple[str, str]] = []
    inside = False
    for line in _section().splitlines():
        if line.startswith(f"| `{root}` |"):
            inside = True
        elif inside and line.startswith("|"):
            if not line.startswith("|---"):
                rows.append((line.split("|")[1], line))
        elif inside:
            break
    assert rows, f"the README's layout section has no table for {root}"
    return rows


def _modules(base: Path) -> list[Path]:
    """Every module and C source under `base`, but the generated code (`v1/`, named as a folder) and the
    `__init__.py` of sub-packages."""
    found = (p.relative_to(base) for p in [*base.rglob("*.py"), *base.rglob("*.c")] if "__pycache__" not in p.parts)
    return sorted(p for p in found if p.parts[0] != "v1" and not (p.name == "__init__.py" and len(p.parts) > 1))


@pytest.mark.parametrize("root", list(ROOTS))
def test_every_module_is_named_in_the_row_of_its_folder(root: str) -> None:
    rows = _table(root)
    table = "\n".join(row for _, row in rows)
    missing = []
    for module in _modules(ROOTS[root]):
        if len(module.parts) == 1:
            if f"`{module.name}`" not in table:
                missing.append(str(module))
            continue
        row = next((r for first, r in rows if f"`{module.parts[0]}/`" in first), "")
        if not all(f"`{part}/`" in row for part in module.parts[1:-1]) or f"`{module.name}`" not in row:
            missing.append(str(module))
    assert not missing, f"README.md's layout section does not name {missing} (in the row of its folder)"


@pytest.mark.parametrize("root", list(ROOTS))
def test_every_name_in_the_layout_exists(root: str) -> None:
    base = ROOTS[root]
    present = {p.name for p in base.rglob("*") if "__pycache__" not in p.parts}
    present |= {p.name + "/" for p in base.rglob("*") if p.is_dir()}
    stale = [name for _, row in _table(root) for name in NAME.findall(row) if name not in present]
    assert not stale, f"README.md's layout section names {stale}, which {root} does not have"
