"""Best-effort pinning of the host-staged buffer: a failed cudaHostRegister is logged and its CUDA error read back
(cleared), so that torch's next kernel-launch check does not report it as the kernel's own failure. No GPU here:
torch's cudart bindings are stood in for; the library lookup itself runs for real on a library every process has."""

from __future__ import annotations

import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

from kvbroker.integrations.vllm import cudart, gpu  # noqa: E402

HOST_MEMORY_ALREADY_REGISTERED = 712


class _Cudart:
    """torch.cuda.cudart() as far as pinning uses it."""

    def __init__(self, results: list[int]) -> None:
        self.results, self.registered = results, list[int]()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append(ptr)
        return self.results.pop(0)


def _staged(buffers: int, results: list[int], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Cudart, list[str]]:
    fake = _Cudart(results)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    cleared: list[str] = []

    def clear() -> int:
        cleared.append("read")
        return HOST_MEMORY_ALREADY_REGISTERED

    monkeypatch.setattr(gpu, "clear_last_error", clear)
    staged = gpu.HostStaged.__new__(gpu.HostStaged)  # only its host buffers: no daemon, no device
    staged.host = [torch.zeros(4096, dtype=torch.uint8) for _ in range(buffers)]
    return staged, fake, cleared


def test_a_failed_pin_is_logged_and_its_cuda_error_cleared(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    staged, fake, cleared = _staged(3, [0, HOST_MEMORY_ALREADY_REGISTERED], monkeypatch)
    with caplog.at_level(logging.WARNING):
        pinned = staged._pin()
    assert pinned == [staged.host[0].data_ptr()] and len(fake.registered) == 2  # stops at the first failure
    assert cleared == ["read"]
    assert "cannot pin the host KV buffer (cudaHostRegister error 712)" in caplog.text


def test_a_pin_that_succeeds_reads_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    staged, _, cleared = _staged(2, [0, 0], monkeypatch)
    assert len(staged._pin()) == 2 and cleared == []


def test_the_library_is_found_among_those_loaded_and_never_loaded_anew() -> None:
    libc = cudart.loaded_library("libc.so")
    assert libc is not None and libc.getpid() > 0
    assert cudart.loaded_library("libkvbroker-no-such-library") is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch loads libcudart")
def test_without_a_loaded_libcudart_nothing_is_cleared_and_nothing_loaded() -> None:
    # A CPU torch loads no libcudart: the call says so (None) rather than loading a runtime of its own.
    assert cudart.loaded_library("libcudart.so") is None
    assert cudart.clear_last_error() is None


def test_clearing_reads_the_error_from_torchs_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    errors = [HOST_MEMORY_ALREADY_REGISTERED, 0]

    class _Runtime:
        def cudaGetLastError(self) -> int:
            return errors.pop(0)

    monkeypatch.setattr(cudart, "loaded_library", lambda prefix: _Runtime() if prefix == "libcudart.so" else None)
    assert cudart.clear_last_error() == HOST_MEMORY_ALREADY_REGISTERED
    assert cudart.clear_last_error() == 0
