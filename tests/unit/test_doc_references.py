"""Docs cite only files a reader has: every `path.ext` in backticks in the README, BENCHMARKS.md and docs/ names a
file of this repository (by its path, or by its name where no folder is given), every relative link leads to a file
and, where it names one, to a heading of it, and no doc points at an issue tracker a reader cannot open."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}
DOCS = sorted({REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "bench" / "README.md", *REPO.glob("docs/*.md"),
               *REPO.glob("deploy/**/*.md"), *REPO.glob("examples/**/*.md")})
CITED = re.compile(r"`([\w./-]+\.(?:py|md|sh|toml|yaml|yml|c|json|txt))`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"(#{1,6}) (.+)")
TRACKER = re.compile(r"\b[Ii]ssues? #?\d+\b|(?<![\w/])#\d{1,4}\b(?!\.\d)")


@functools.cache
def _files() -> frozenset[str]:
    found = set()
    for top, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP and "venv" not in d]
        found |= {(Path(top) / n).relative_to(REPO).as_posix() for n in names}
    return frozenset(found)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_cited_files_exist(doc: Path) -> None:
    files = _files()
    names = {f.rpartition("/")[2] for f in files}
    missing = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for cited in CITED.findall(line):
            path = cited.removeprefix("./")
            if path.startswith("../"):
                path = (doc.parent / path).resolve().relative_to(REPO).as_posix()
            found = any(f == path or f.endswith("/" + path) for f in files) if "/" in path else path in names
            if not found:
                missing.append(f"line {n}: {cited}")
    assert not missing, f"{doc.name} cites files this repository does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_tracker_a_reader_cannot_open(doc: Path) -> None:
    cited = [f"line {n}: {m.group(0)}" for n, line in enumerate(doc.read_text().splitlines(), 1)
             if "github.com" not in line for m in TRACKER.finditer(line)]
    assert not cited, f"{doc.name} points at issues a reader cannot look up (name the section or link it): {cited}"


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif (m := HEADING.fullmatch(line)) and not in_code:
            slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
    return {f"{slug}-{n}" if n else slug for slug, last in seen.items() for n in range(last + 1)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # a web address, checked by no test here
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists():
                broken.append(f"line {n}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"line {n}: {target} (no such heading)")
    assert not broken, f"{doc.name} links to what is not there: {broken}"
