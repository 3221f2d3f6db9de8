"""`Client` and `AsyncClient` come from one table of calls (`kvbroker._client._Calls`): every RPC of the local API has
a row, both clients expose it with the same signature, and its one docstring says what it takes (Args), gives
(Returns) and raises (Raises)."""

from __future__ import annotations

import builtins
import inspect
import re

import pytest

import kvbroker
from kvbroker import AsyncClient, Client
from kvbroker._client import CALLS, _Calls, _Rpc
from kvbroker.v1 import broker_pb2

# RPCs the clients use without a method of their own name: the session keep-alive runs in the background, and the
# layer-wise stream is `Client.pull_kv_blocks(on_layer=...)` and `AsyncClient.pull_kv_blocks_stream`.
NOT_A_ROW = {"keep_alive", "pull_kv_blocks_stream"}
# Rows that are another way to call an RPC that has a row of its own name.
VARIANTS = {"pull_granted_kv_blocks": "pull_kv_blocks"}
SECTIONS = ("Args", "Returns", "Raises")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _row(name: str) -> _Rpc[..., object]:
    row = vars(_Calls)[name]
    assert isinstance(row, _Rpc)
    return row


def _sections(doc: str | None) -> dict[str, dict[str, str]]:
    """A Google-style docstring's sections: {"Args": {name: text}, "Returns": {"": text}, "Raises": {Error: text}}."""
    assert doc, "no docstring"
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    section = key = ""
    for line in inspect.cleandoc(doc).splitlines():
        text = line.strip()
        if not line.startswith(" "):  # a section header, prose or a blank line
            if text.endswith(":") and text[:-1] in SECTIONS:
                section = text[:-1]
                current = sections.setdefault(section, {})
            elif text:
                current = None
        elif current is None:
            continue
        elif section == "Returns":
            current[""] = f"{current.get('', '')} {text}".strip()
        elif line.startswith(" " * 8) and key in current:  # an entry's continuation
            current[key] += " " + text
        else:
            key, _, entry = text.partition(":")
            current[key] = entry.strip()
    return sections


def _public(cls: type) -> list[str]:
    return [n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))]


def test_every_rpc_of_the_local_api_is_a_row_of_the_table() -> None:
    rpcs = {_snake(m.name) for m in broker_pb2.DESCRIPTOR.services_by_name["KvBroker"].methods}
    assert set(CALLS) - set(VARIANTS) == rpcs - NOT_A_ROW
    assert set(VARIANTS.values()) <= set(CALLS)
    assert len(CALLS) == len(set(CALLS))


@pytest.mark.parametrize("name", CALLS)
def test_both_clients_expose_the_row_with_its_signature(name: str) -> None:
    row = _row(name)
    table = row.signature
    on_async = getattr(AsyncClient, name)
    assert on_async is row.awaitable, f"AsyncClient.{name} is not the table's"
    assert inspect.signature(on_async) == table, name
    on_sync = getattr(Client, name)
    assert not inspect.iscoroutinefunction(on_sync), name
    if on_sync is row.blocking:
        assert inspect.signature(on_sync) == table, name
        assert on_sync.__doc__ == on_async.__doc__ == row.spec.__doc__
        return
    # Client's own version of a row may only add keyword-only parameters with defaults: whatever runs on the table's
    # signature runs on it, and returns the same.
    sync = inspect.signature(on_sync)
    params = list(sync.parameters.values())
    n = len(table.parameters)
    assert params[:n] == list(table.parameters.values()), name
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in params[n:]), name
    assert sync.return_annotation == table.return_annotation, name
    # ... and its docstring repeats the row's for every parameter they share (they cannot drift apart).
    ours, theirs = _sections(on_sync.__doc__), _sections(row.spec.__doc__)
    assert {k: v for k, v in ours["Args"].items() if k in theirs["Args"]} == theirs["Args"], name
    assert ours["Returns"] == theirs["Returns"], name


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_every_call_says_what_it_takes_gives_and_raises(cls: type) -> None:
    for name in _public(cls):
        fn = getattr(cls, name)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if name == "close":
            continue  # takes nothing, returns nothing
        sections = _sections(fn.__doc__)
        assert set(SECTIONS) <= set(sections), f"{cls.__name__}.{name}: {sorted(sections)}"
        assert list(sections["Args"]) == params, f"{cls.__name__}.{name}: Args document {list(sections['Args'])}"
        assert all(sections["Args"].values()), f"{cls.__name__}.{name}: an empty Args entry"
        assert sections["Returns"].get(""), f"{cls.__name__}.{name}: empty Returns"
        for error, text in sections["Raises"].items():
            assert isinstance(getattr(kvbroker, error, None) or getattr(builtins, error, None), type), \
                f"{cls.__name__}.{name} raises {error!r}, which is no exception"
            assert text, f"{cls.__name__}.{name}: {error} says not when"


def test_the_docstring_parser_sees_a_missing_section() -> None:
    """The checks above can fail: a row whose docstring lacks Raises, or documents a parameter it lacks, is caught."""
    doc = """Does a thing.

    Args:
        cache: the cache.
        timeout: deadline in seconds,
            continued.

    Returns:
        None.
    """
    sections = _sections(doc)
    assert sections == {"Args": {"cache": "the cache.", "timeout": "deadline in seconds, continued."},
                        "Returns": {"": "None."}}
    assert "Raises" not in sections
