"""What tests/device/cuda_check.py judges beyond byte checks: a GB/s floor per mode relative to the device's own
memcpy measured in the same run, and which UCX transport moved the bytes (from UCX_PROTO_INFO=y tables in the
daemons' logs). Pure functions of recorded numbers and log text: tested on the CPU (tests/device/test_verdicts.py).

The floor: a mode fails below FLOOR_FRACTION of the copy its bytes would take without kvbroker, measured on the same
device in the same run (so no number depends on which GPU the machine has):
- device-direct (the raw nixl check, the connector's device mode): against the device-to-device memcpy. UCX's
  cuda_ipc lane copies GPU memory with the GPU itself, near memcpy rate; the pulls move 256-512 MiB, so the fixed
  cost of a pull (gRPC, NIXL posting, a few ms at most) leaves them well above 5%. Every fallback UCX can take crosses
  host memory instead: its software path over TCP (about 0.3 GB/s, ai-dynamo/nixl#1754) or a cuda_copy bounce through
  host buffers bounded by PCIe (25-50 GB/s on Gen5, 1-3% of an H100's or H200's device memcpy). 5% tells them apart.
- host-staged (the connector's host mode): against the pinned device-to-host memcpy, the lane its bytes leave the
  GPU by. Its pull also copies host to host between the daemons and host to device, so it runs well under that
  memcpy even when healthy; 5% catches only gross slow paths (the tcp backend's software copies instead of shm, a
  CPU-bound copy loop), not a merely unpinned buffer.
"""

from __future__ import annotations

import re
from typing import Any

FLOOR_FRACTION = {"device": 0.05, "host": 0.05}
BASELINE_OF = {"device": "device-to-device memcpy", "host": "pinned device-to-host memcpy"}


def floor_verdict(mode: str, pull_gbps: float, baseline_gbps: float | None, fraction: float | None = None
                  ) -> dict[str, Any]:
    """{"ok", "floor_GBps", ...}: whether `pull_gbps` reaches `fraction` of the device's own memcpy. Without a
    baseline (not measured, or 0) the floor cannot be applied: ok False, saying so (a check that cannot tell a slow
    path from a fast one must not pass silently)."""
    fraction = FLOOR_FRACTION[mode] if fraction is None else fraction
    out: dict[str, Any] = {"fraction": fraction, "baseline": BASELINE_OF[mode], "baseline_GBps": baseline_gbps,
                           "pull_GBps": pull_gbps}
    if not baseline_gbps or baseline_gbps <= 0:
        return {**out, "ok": False, "why": f"no {BASELINE_OF[mode]} measured in this run: the floor cannot be applied"}
    floor = round(fraction * baseline_gbps, 2)
    ok = pull_gbps >= floor
    out.update(ok=ok, floor_GBps=floor)
    if not ok:
        out["why"] = (f"pull {pull_gbps} GB/s is under the floor {floor} GB/s ({fraction:.0%} of the "
                      f"{BASELINE_OF[mode]}, {baseline_gbps} GB/s): the bytes took a slow path")
    return out


_PREFIX = re.compile(r"^[^|]*\|")  # "[1767930429.28] [host:13245:0]   |..." or "... proto_debug.c:406  UCX  INFO  |..."
_RANGE = re.compile(r"^\d+[KMG]?\.\.(\d+[KMG]?|inf)$")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\[\]-]+)")


def ucx_protocols(log_text: str) -> list[dict[str, Any]]:
    """UCX_PROTO_INFO=y tables in a log: one entry per table, {"context", "operation", "rows": [{"range",
    "protocol", "lanes"}]}. A table is a header row of two cells (context and configuration | what the protocols do,
    e.g. "remote memory read by ucp_get* from cuda/GPU0 to cuda/GPU0") followed by rows of three (message size range
    | protocol | transport/device lanes)."""
    tables: list[dict[str, Any]] = []
    for line in log_text.splitlines():
        if "|" not in line or not _PREFIX.match(line):
            continue
        cells = [c.strip() for c in _PREFIX.sub("", line, count=1).rstrip().rstrip("|").split("|")]
        if len(cells) == 2 and cells[0] and cells[1] and not _RANGE.match(cells[0]):
            tables.append({"context": cells[0], "operation": cells[1], "rows": []})
        elif len(cells) == 3 and _RANGE.match(cells[0]) and tables:
            lanes = [f"{tl}/{dev}" for tl, dev in _LANE.findall(cells[2])]
            tables[-1]["rows"].append({"range": cells[0], "protocol": cells[1], "lanes": lanes})
    return [t for t in tables if t["rows"]]


def ucx_summary(log_text: str, max_tables: int = 12) -> dict[str, Any]:
    """What moved large transfers: per operation (header text), the transports of its unbounded ("..inf") row,
    which every multi-kilobyte block transfer uses; plus the tables themselves (the first `max_tables`). Empty
    `large_transfers` means UCX printed no table: UCX_PROTO_INFO was not set, or UCX printed elsewhere."""
    tables = ucx_protocols(log_text)
    large: dict[str, list[str]] = {}
    for t in tables:
        last = next((r for r in reversed(t["rows"]) if r["range"].endswith("..inf")), None)
        if last is not None:
            transports = sorted({lane.split("/")[0] for lane in last["lanes"]})
            merged = sorted({*large.get(t["operation"], []), *transports, *([last["protocol"]] if not transports
                                                                             else [])})
            large[t["operation"]] = merged
    device_ops = {op: tl for op, tl in large.items() if re.search(r"from cuda\S* .*to cuda", op)}
    transports = sorted({tl for tls in device_ops.values() for tl in tls})
    return {"large_transfers": large, "device_to_device_transports": transports,
            "cuda_ipc": "cuda_ipc" in transports, "tables": tables[:max_tables]}
