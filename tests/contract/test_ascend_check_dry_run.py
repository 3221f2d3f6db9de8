"""A dry run of tests/device/ascend_check.py's adapter part against `hixl_contract_standin` (NOT HIXL): its two
roles run as threads of this process instead of processes on two NPUs, so that the script's own protocol, plans
and byte checks are known to work before anyone spends hardware time on it. It proves nothing about NPUs."""

from __future__ import annotations

import multiprocessing
import sys
import threading
from typing import Any

import pytest

from tests.contract import hixl_contract_standin as standin
from tests.device import ascend_check


@pytest.fixture
def hixl(monkeypatch: pytest.MonkeyPatch) -> Any:
    standin.reset()
    monkeypatch.setitem(sys.modules, "hixl", standin)
    monkeypatch.setitem(sys.modules, "acl", standin.acl)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # NPU memory through the (stand-in) pyACL calls
    yield standin
    assert standin.VIOLATIONS == []


def test_adapter_part_passes_on_the_standin(hixl: Any) -> None:
    assert ascend_check.skip_reason([0, 1]) is None
    src_end, src_child = multiprocessing.Pipe()
    dst_end, dst_child = multiprocessing.Pipe()
    nbytes = 4 << 20
    roles = [threading.Thread(target=ascend_check.source_process,
                              args=(src_child, 0, "127.0.0.1:26100", "roce:device", nbytes)),
             threading.Thread(target=ascend_check.destination_process,
                              args=(dst_child, 1, "127.0.0.1:26101", "roce:device", nbytes))]
    for role in roles:
        role.start()
    results = ascend_check._relay(src_end, dst_end)
    for role in roles:
        role.join(10)
    assert "error" not in results, results.get("error")
    assert all(results[k] for k in ("read_scattered_ok", "read_contiguous_ok", "read_after_relink_ok", "write_ok",
                                    "read_after_abandon_ok", "teardown_ok"))
    assert results["relinks"] == 2
    assert results["unregistered_local_status"] == standin.PARAM_INVALID
    assert standin.live_engines() == []
