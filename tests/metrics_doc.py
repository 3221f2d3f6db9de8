"""The metric list of docs/vllm.md ("### Metrics"), read as a test reads it, and compared with a `/metrics` page.

The doc names a series in backticks: `name`, `name{label, ...}`, with a label's values inline (`label=a|b|c`) or, for
the engine's series, in a sentence of their own ("`label` is one of `a` (why), `b`, ..."). A label named without values
(`op`, `peer`, ...) has an open set of values and is not compared; a quoted value (`op="pull_blocks"`) is a selector,
not a listing. Compared: the series' names both ways (the connector's settings, `kvbroker_pull_timeout_s`, are not
series), and each listed value of a label: no other value is exposed, and on a series whose labels are all listed,
every listed value exists at zero before anything happened.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvbroker.integrations.vllm.config import KEY_PREFIX, ConnectorConfig

VLLM_DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"

_SERIES = re.compile(r"`((?:vllm:)?kvbroker_[a-z_]+)(?:\{([^}`]*)\})?`")
_ONE_OF = re.compile(r"`([a-z_]+)` is one of (.*?)\.(?:\s|$)", re.DOTALL)


@dataclass
class Series:
    labels: set[str] = field(default_factory=set)
    values: dict[str, set[str]] = field(default_factory=dict)
    """Label -> the values the doc lists for it (only labels with a listed set)."""

    @property
    def all_listed(self) -> bool:
        """Every label has listed values, so every label set can exist from the start."""
        return bool(self.labels) and self.labels == set(self.values)


def metrics_section(text: str | None = None) -> str:
    text = VLLM_DOC.read_text() if text is None else text
    start = text.index("### Metrics\n")
    end = text.index("\n## ", start)
    return text[start:end]


def documented_series(prefix: str, text: str | None = None) -> dict[str, Series]:
    """The series of the Metrics section whose names start with `prefix`, each with its labels and listed values."""
    section = metrics_section(text)
    one_of = {}
    for label, sentence in _ONE_OF.findall(section):
        # Each value is a backticked word outside the parentheses that explain it.
        plain = re.sub(r"\([^()]*\)", "", sentence)
        one_of[label] = set(re.findall(r"`([A-Za-z_]+)`", plain))
    settings = {KEY_PREFIX + f.name for f in dataclasses.fields(ConnectorConfig)}
    documented: dict[str, Series] = {}
    for name, labels in _SERIES.findall(section):
        if not name.startswith(prefix) or name in settings:
            continue
        series = documented.setdefault(name, Series())
        for label in filter(None, (part.strip() for part in labels.split(","))):
            label, _, values = label.partition("=")
            if values.startswith('"'):
                continue
            series.labels.add(label)
            if values:
                series.values[label] = set(values.split("|"))
            elif label in one_of and name.startswith("vllm:"):
                series.values[label] = one_of[label]
    return documented


@dataclass
class Exposed:
    names: set[str]
    """Family names as the text format declares them (`# TYPE`): counters with `_total`, histograms without suffix."""
    values: dict[tuple[str, str], set[str]]
    """(family name, label) -> the values its samples carry."""


def exposed_series(text: str, prefix: str) -> Exposed:
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    # `_created` gauges are prometheus_client's creation timestamps of counters (vLLM's server turns them off).
    names = {name for name in names if name.startswith(prefix) and not name.endswith("_created")}
    values: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        if name not in names:
            continue
        for sample in family.samples:
            for label, value in sample.labels.items():
                values.setdefault((name, label), set()).add(value)
    return Exposed(names, values)


def differences(documented: dict[str, Series], exposed: Exposed) -> list[str]:
    """What the doc and the page disagree on, in words (empty: they agree)."""
    problems = [f"{name}: documented, not exposed" for name in sorted(set(documented) - exposed.names)]
    problems += [f"{name}: exposed, not documented" for name in sorted(exposed.names - set(documented))]
    for name, series in sorted(documented.items()):
        if name not in exposed.names:
            continue
        for label, listed in sorted(series.values.items()):
            seen = exposed.values.get((name, label), set())
            if series.all_listed and listed - seen:
                problems.append(f"{name}{{{label}}}: {sorted(listed - seen)} documented, not exposed (at zero)")
            if seen - listed:
                problems.append(f"{name}{{{label}}}: {sorted(seen - listed)} exposed, not documented")
    return problems
