"""BOOKKEEPING ONLY: the CUDA IPC importer's reference counts, all-or-nothing imports and close order, checked
against a fake cuda-python runtime that records calls. It shows nothing about CUDA itself (that a handle opens, that
the memory is the exporter's): tests/device/cuda_check.py does, on a GPU."""

from __future__ import annotations

import uuid

import pytest

from kvbroker import LlmStatus
from kvbroker.status import LlmError
from kvbrokerd.backends.common.cudaipc import CudaIpcImporter, parse_device
from tests.fakecuda import GPU0, GPU1, SIZE, FakeRuntime


def _handle(tag: bytes) -> bytes:
    return tag.ljust(64, b".")


def _importer() -> tuple[CudaIpcImporter, FakeRuntime]:
    rt = FakeRuntime()
    return CudaIpcImporter(rt, rt), rt


def _ops(rt: FakeRuntime, op: str) -> list[bytes]:
    return [c[1] for c in rt.calls if c[0] == op]


def test_bookkeeping_one_open_per_device_and_handle_shared_by_caches() -> None:
    imp, rt = _importer()
    a = imp.import_tensors("0", [_handle(b"AAAA"), _handle(b"AAAA")], [0, 4096], [SIZE, SIZE], 4096)
    b = imp.import_tensors(f"GPU-{GPU0}", [_handle(b"AAAA")], [8192], [SIZE], 4096)
    assert _ops(rt, "open") == [b"AAAA"]
    assert a.addresses[1] - a.addresses[0] == 4096 and b.addresses[0] - a.addresses[0] == 8192
    assert a.device == b.device == 0
    imp.release(a)
    assert _ops(rt, "close") == []  # cache b still uses the mapping
    imp.release(b)
    assert _ops(rt, "close") == [b"AAAA"] and imp.open_mappings == 0
    imp.release(b)  # twice: nothing more
    assert _ops(rt, "close") == [b"AAAA"]


def test_bookkeeping_the_same_handle_on_another_device_is_another_mapping() -> None:
    imp, rt = _importer()
    imp.import_tensors("0", [_handle(b"AAAA")], [0], [SIZE], 64)
    imp.import_tensors(f"GPU-{GPU1}", [_handle(b"AAAA")], [0], [SIZE], 64)
    assert _ops(rt, "open") == [b"AAAA", b"AAAA"] and ("set", 1) in rt.calls
    imp.close_all()
    assert len(_ops(rt, "close")) == 2 and imp.open_mappings == 0


def test_bookkeeping_a_failed_import_closes_what_it_opened_and_keeps_the_rest() -> None:
    imp, rt = _importer()
    kept = imp.import_tensors("0", [_handle(b"KEEP")], [0], [SIZE], 64)
    with pytest.raises(LlmError) as info:
        imp.import_tensors("0", [_handle(b"KEEP"), _handle(b"NEW1"), _handle(b"bad!")], [0, 0, 0], [SIZE] * 3, 64)
    assert info.value.status == LlmStatus.LLM_PARAM_INVALID and "cudaErrorMapBufferObjectFailed" in info.value.message
    assert _ops(rt, "close") == [b"NEW1"]  # KEEP is still the first cache's
    imp.release(kept)
    assert _ops(rt, "close") == [b"NEW1", b"KEEP"] and imp.open_mappings == 0


def test_bookkeeping_a_claim_beyond_the_real_allocation_is_refused_and_closed() -> None:
    imp, rt = _importer()
    rt.sizes[_handle(b"TINY")] = 4096
    with pytest.raises(LlmError) as info:
        imp.import_tensors("0", [_handle(b"TINY")], [0], [SIZE], 4096)
    assert info.value.status == LlmStatus.LLM_PARAM_INVALID
    assert "exported allocation is 4096 bytes" in info.value.message
    with pytest.raises(LlmError):
        imp.import_tensors("0", [_handle(b"TINY")], [1], [4096], 4096)
    assert _ops(rt, "close") == [b"TINY", b"TINY"] and imp.open_mappings == 0


def test_bookkeeping_close_all_closes_every_mapping_once() -> None:
    imp, rt = _importer()
    for tag in (b"A000", b"B000", b"A000"):
        imp.import_tensors("0", [_handle(tag)], [0], [SIZE], 64)
    imp.close_all()
    assert sorted(_ops(rt, "close")) == [b"A000", b"B000"]
    assert imp.close_all() == []


def test_devices_are_ordinals_or_visible_uuids() -> None:
    uuids = [GPU0.bytes, GPU1.bytes]
    assert parse_device("1", uuids) == 1
    assert parse_device(f"GPU-{GPU1}", uuids) == 1
    assert parse_device(str(GPU0), uuids) == 0
    for bad, words in (("2", "does not exist"), (f"GPU-{uuid.uuid4()}", "not visible"), ("GPU-zz", "neither")):
        with pytest.raises(LlmError) as info:
            parse_device(bad, uuids)
        assert info.value.status == LlmStatus.LLM_PARAM_INVALID and words in info.value.message
