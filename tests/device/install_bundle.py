"""Installs the wheels tests/device/bundle.sh assembled, one by one, into a target folder (on PYTHONPATH for the
check): each wheel this Python can take is installed, each other one is skipped with the reason, and nothing stops
the rest. One pip command for all of them would refuse everything for one wheel built for another Python (nixl-cu13
is built per CPython version), and the host-staged mode needs only the pure-Python ones (grpcio-health-checking...).

    python3 tests/device/install_bundle.py .whl /tmp/kvb-site --report bundle.json

The report (JSON, also printed): per wheel, installed or not and why; tests/device/cuda_check.py carries it in its
result (`--bundle-report`) and says which modes could not run for want of a wheel.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def unsupported_reason(wheel: Path) -> str | None:
    """Why this Python cannot take the wheel (its tags name none of this interpreter's), or None. Uses the
    `packaging` that pip vendors (always there when pip is), so nothing needs installing first."""
    try:
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import parse_wheel_filename
    except ImportError:  # no pip to ask: let the install itself decide
        return None
    try:
        _, _, _, tags = parse_wheel_filename(wheel.name)
    except Exception as e:  # a file that is no wheel
        return f"not a wheel file name: {e}"
    supported = set(sys_tags())
    if tags & supported:
        return None
    wanted = sorted({t.interpreter for t in tags})
    return (f"built for {', '.join(wanted)}; this Python is cp{sys.version_info.major}{sys.version_info.minor} "
            f"({sys.executable})")


def install(wheel_dir: Path, target: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"python": sys.version.split()[0], "target": str(target), "wheels": []}
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        report["note"] = f"no wheels in {wheel_dir}: nothing installed (the host's packages must do)"
        return report
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        entry: dict[str, Any] = {"wheel": wheel.name, "installed": False}
        reason = unsupported_reason(wheel)
        if reason is None:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                   "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(target),
                                   str(wheel)], capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                entry["installed"] = True
            else:
                reason = (done.stderr.strip() or done.stdout.strip() or f"pip exited {done.returncode}")[-500:]
        if reason is not None:
            entry["why_not"] = reason
        report["wheels"].append(entry)
    report["skipped"] = [w["wheel"] for w in report["wheels"] if not w["installed"]]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel_dir", type=Path)
    ap.add_argument("target", type=Path)
    ap.add_argument("--report", type=Path)
    args = ap.parse_args(argv)
    report = install(args.wheel_dir, args.target)
    text = json.dumps(report, indent=1)
    print(text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    return 0  # a wheel that could not be installed is a result, not a failure: the check says what it cost


if __name__ == "__main__":
    sys.exit(main())
