"""The daemon's floors, read from its imports: no folder of `server/kvbrokerd` imports from a floor above it.

From the top: `service/` (requests in, answers out) over `transfers/` (one pass per request) over `backends/` (the
engines) over `links/` (who we talk to) over the seam (`dataplane/seam.py`: what an engine implements) over
`registry/` (what we serve) over the rest of `dataplane/` (block pairs, plans, claims). Every import counts,
wherever it is written: at the top, in a function, or under `if TYPE_CHECKING:` (an annotation names a dependency
of the contract as much as a call does).
An arrow running back up that exists today is listed in `KNOWN_UPWARD` with why, rather than the rule loosened; the
list is checked too, so that fixing one fails until its entry is removed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DAEMON = Path(__file__).resolve().parents[2] / "server" / "kvbrokerd"

ABOVE = {
    "dataplane": frozenset({"transfers", "backends", "service", "links", "registry"}),
    "dataplane/seam.py": frozenset({"transfers", "backends", "service", "links"}),
    "registry": frozenset({"transfers", "service", "backends", "dataplane.seam"}),
    "links": frozenset({"transfers", "service", "backends"}),
    "backends": frozenset({"transfers", "service"}),
    "transfers": frozenset({"service"}),
}
"""Each folder (or a module with a floor of its own) -> what it must not import from. The seam is the one module of
`dataplane/` a floor up: it names the registry's entries that engines are handed, so it sits over `registry/` (which
must then not name it) and under `links/` and `backends/`."""

KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""(module, what it imports) -> why: arrows running back up that exist today, each one to remove."""


def imported(rel: Path, source: str) -> list[str]:
    """The absolute names every import statement of a module at `rel` (relative to the daemon's folder) names:
    `kvbrokerd.a.b` for `import kvbrokerd.a.b`, `from kvbrokerd.a import b`, `from ..a import b`."""
    package = ["kvbrokerd", *rel.parts[:-1]]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def upward(rel: Path, source: str) -> list[str]:
    """What the module at `rel` imports from a floor above its own."""
    own = ABOVE.get(rel.as_posix())
    forbidden = own if own is not None else ABOVE.get(rel.parts[0], frozenset()) if len(rel.parts) > 1 else frozenset()
    prefixes = tuple(f"kvbrokerd.{floor}" for floor in forbidden)
    return [name for name in imported(rel, source) if any(name == p or name.startswith(p + ".") for p in prefixes)]


def _arrows() -> set[tuple[str, str]]:
    arrows = set()
    for path in sorted(DAEMON.rglob("*.py")):
        rel = path.relative_to(DAEMON)
        arrows |= {(rel.as_posix(), name) for name in upward(rel, path.read_text())}
    return arrows


def _module_of(name: str) -> str:
    """`kvbrokerd.registry.caches` for `kvbrokerd.registry.caches.CacheEntry` where that is a module of ours."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        base = DAEMON.joinpath(*parts[1:n])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return ".".join(parts[:n])
    return name


@pytest.mark.parametrize("floor", list(ABOVE))
def test_no_folder_imports_from_a_floor_above_it(floor: str) -> None:
    found = {(module, _module_of(name)) for module, name in _arrows()
             if module == floor or module.startswith(f"{floor}/")}
    new = sorted(found - set(KNOWN_UPWARD))
    assert not new, f"{floor}/ imports from a floor above it ({sorted(ABOVE[floor])}): {new}"


def test_every_known_upward_arrow_is_still_there() -> None:
    present = {(module, _module_of(name)) for module, name in _arrows()}
    gone = sorted(set(KNOWN_UPWARD) - present)
    assert not gone, f"these arrows no longer run back up: remove them from KNOWN_UPWARD: {gone}"


@pytest.mark.parametrize("source", [
    "from kvbrokerd.transfers.planner import plan_blocks",
    "import kvbrokerd.backends.base",
    "from kvbrokerd import service",
    "from ..transfers import planner",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvbrokerd.registry.caches import CacheEntry",
    "def later() -> None:\n    from kvbrokerd.links.table import LinkTable",
])
def test_an_upward_import_is_seen_however_it_is_written(source: str) -> None:
    assert upward(Path("dataplane/new.py"), source)


@pytest.mark.parametrize("source", [
    "from kvbrokerd.dataplane.plan import Plan",
    "from kvbrokerd.errors import fail",
    "from . import plan",
    "from kvbroker.types import CacheDesc",
])
def test_an_import_from_the_same_floor_or_below_passes(source: str) -> None:
    assert not upward(Path("dataplane/new.py"), source)
