"""The operator CLI as an operator runs it (`python -m kvbroker._cli ...` in a subprocess) against real daemons:
link, unlink, pull, bench, the table commands, the --target forms, and errors that name their LLM status with a
hint and exit non-zero."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbroker import Cache, CacheDesc, ClusterInfo
from kvbroker._bench import Progress
from kvbroker._cli import _hint, build_parser
from kvbroker._format import fmt_gbps
from kvbroker._local import LocalDaemon
from kvbroker.status import LlmStatus
from tests.helpers import fill, wait_until


def kvbroker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbroker._cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@dataclass
class Env:
    remote: LocalDaemon  # cluster 1: the source of pulls
    local: LocalDaemon  # cluster 2: the daemon the CLI talks to
    src: Cache
    dst: Cache

    def pull_args(self, *extra: str) -> list[str]:
        return ["pull", "--target", self.local.target, "--src-cluster", "1", "--src-cache", str(self.src.cache_id),
                "--dst-cache", str(self.dst.cache_id), *extra]

    def link(self) -> None:
        with self.local.client() as c:
            assert c.link_clusters([ClusterInfo(1, self.remote.peer_address)])[0].ok

    def unlink(self) -> None:
        with self.local.client() as c:
            c.unlink_clusters([ClusterInfo(1, self.remote.peer_address)], force=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("cli")
    desc = CacheDesc(num_tensors=4, shape=(16, 8, 64))  # 2 layers of K, V
    with LocalDaemon(tmp, 1) as remote, LocalDaemon(tmp, 2) as local, remote.client() as rc, local.client() as lc:
        src, dst = rc.allocate_cache(desc), lc.allocate_cache(desc)
        fill(src, 5)
        yield Env(remote, local, src, dst)


def test_link_then_links_then_unlink(env: Env) -> None:
    out = kvbroker("link", "--target", env.local.target, "--cluster", "1", "--address", env.remote.peer_address)
    assert out.returncode == 0, out.stderr
    assert "linked cluster 1: LLM_SUCCESS" in out.stdout and "READY over shm" in out.stdout
    try:
        links = kvbroker("links", "--target", env.local.target)
        assert links.returncode == 0
        header, row = links.stdout.splitlines()
        assert header.split() == ["CLUSTER", "ADDRESS", "STATE", "BACKEND", "REASON"]
        assert row.split() == ["1", env.remote.peer_address, "READY", "shm"]
        again = kvbroker("link", "--target", env.local.target, "--cluster", "1", "--address", env.remote.peer_address)
        assert again.returncode == 1
        assert "error: LLM_ALREADY_LINK: " in again.stderr and "hint: already linked" in again.stderr
    finally:
        out = kvbroker("unlink", "--target", env.local.target, "--cluster", "1")  # address from the link table
    assert out.returncode == 0, out.stderr
    assert "unlinked cluster 1: LLM_SUCCESS" in out.stdout
    with env.local.client() as c:
        assert c.list_links() == []
    again = kvbroker("unlink", "--target", env.local.target, "--cluster", "1")
    assert again.returncode == 1
    assert "error: LLM_NOT_YET_LINK: " in again.stderr and "hint: nothing to unlink" in again.stderr


def test_link_to_nothing_fails_with_a_hint(env: Env) -> None:
    out = kvbroker("link", "--target", env.local.target, "--cluster", "7", "--address", "127.0.0.1:1",
                   "--timeout", "3")
    assert out.returncode == 1
    assert "error: LLM_LINK_FAILED: " in out.stderr and "hint: can this daemon reach --address?" in out.stderr


def test_pull_before_link_says_run_kvbroker_link(env: Env) -> None:
    out = kvbroker(*env.pull_args("--src-blocks", "0", "--dst-blocks", "0"))
    assert out.returncode == 1 and out.stdout == ""
    assert "error: LLM_NOT_YET_LINK: cluster 1 is not linked" in out.stderr
    assert f"hint: run `kvbroker link --target {env.local.target} --cluster 1 --address HOST:PORT`" in out.stderr


def test_pull_moves_the_layer_range_and_prints_the_result(env: Env) -> None:
    env.link()
    try:
        before = [t.copy() for t in env.dst.tensors]
        out = kvbroker(*env.pull_args("--src-blocks", "0-2", "--dst-blocks", "5,6,7", "--layers", "0:0",
                                      "--dst-layers", "1:1", "--tensors-per-layer", "2"))
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()
        assert header.split() == ["TRANSFER", "ID", "BYTES", "SIZE", "BACKEND", "RUNS", "MS", "GB/S"]
        assert row.split()[1] == str(3 * 2 * env.src.desc.block_nbytes) and row.split()[4] == "shm"
        assert float(row.split()[-1]) > 0  # a 6 KiB pull is slow in GB/s, but not 0.00
        s, d = env.src.tensors, env.dst.tensors
        for t in range(2):
            assert np.array_equal(d[2 + t][5:8].view(np.uint8), s[t][0:3].view(np.uint8))
            assert np.array_equal(d[t].view(np.uint8), before[t].view(np.uint8))  # layer 0 untouched

        as_json = kvbroker(*env.pull_args("--src-blocks", "3,4", "--dst-blocks", "8-9", "--json"))
        assert as_json.returncode == 0, as_json.stderr
        result = json.loads(as_json.stdout)
        assert result["bytes_moved"] == 2 * 4 * env.src.desc.block_nbytes and result["backend"] == "shm"
        assert result["transfer_id"] and result["num_runs"] >= 1 and result["seconds"] > 0
        for t in range(4):
            assert np.array_equal(d[t][8:10].view(np.uint8), s[t][3:5].view(np.uint8))
    finally:
        env.unlink()


def test_pull_errors_name_the_status(env: Env) -> None:
    env.link()
    try:
        out = kvbroker(*env.pull_args("--src-blocks", "0", "--dst-blocks", "99"))
        assert out.returncode == 1
        assert "error: LLM_PARAM_INVALID: dst block 99 is out of range" in out.stderr
        assert "hint: check blocks against the caches' block counts" in out.stderr
        out = kvbroker("pull", "--target", env.local.target, "--src-cluster", "1", "--src-cache", "424242",
                       "--dst-cache", str(env.dst.cache_id), "--src-blocks", "0", "--dst-blocks", "0")
        assert out.returncode == 1
        assert "error: LLM_KV_CACHE_NOT_EXIST: " in out.stderr and "kvbroker caches" in out.stderr
    finally:
        env.unlink()


def test_pull_refuses_a_bad_command_line() -> None:
    out = kvbroker("pull", "--src-cluster", "1", "--src-cache", "1", "--dst-cache", "1", "--src-blocks", "0,1",
                   "--dst-blocks", "0")
    assert out.returncode == 2 and "--src-blocks has 2 blocks, --dst-blocks 1" in out.stderr
    out = kvbroker("pull", "--src-cluster", "1", "--src-cache", "1", "--dst-cache", "1", "--src-blocks", "3-1",
                   "--dst-blocks", "0")
    assert out.returncode == 2 and "empty range" in out.stderr


@pytest.mark.parametrize("form", ["unix", "path"])
def test_target_forms(env: Env, form: str) -> None:
    target = {"unix": env.local.target, "path": str(env.local.socket_path)}[form]
    out = kvbroker("status", "--target", target)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split()[:3] == ["CLUSTER", "VERSION", "PEER"]
    assert row.split()[0] == "2" and env.local.peer_address in row


def test_target_host_port(tmp_path: Path) -> None:
    """A daemon whose local API listens on TCP (opt-in: `--listen host:port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LocalDaemon(tmp_path, 5, local_listen=f"127.0.0.1:{port}"):
        out = kvbroker("status", "--target", f"127.0.0.1:{port}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[0] == "5"


def test_caches_table(env: Env) -> None:
    out = kvbroker("caches", "--target", env.local.target)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split() == ["ID", "TENSORS", "SHAPE", "DTYPE", "MIB", "MEMORY"]
    assert f"{env.dst.cache_id}  4        16x8x64  FLOAT16" in out.stdout


def test_bad_target_and_absent_daemon(tmp_path: Path) -> None:
    out = kvbroker("status", "--target", "nonsense")
    assert out.returncode == 2 and "neither unix:///path nor host:port" in out.stderr
    out = kvbroker("links", "--target", f"unix://{tmp_path}/absent.sock", "--timeout", "2")
    assert out.returncode == 1
    assert "error: LLM_FAILED: UNAVAILABLE" in out.stderr and "hint: is kvbrokerd running" in out.stderr


def test_bench_json() -> None:
    out = kvbroker("bench", "--backends", "shm,tcp", "--block-size", "64K", "--total-bytes", "4M", "--pull-bytes",
                   "1M", "--tensors", "4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["config"]["total_bytes"] == 4 << 20
    results = report["results"]
    assert [r["backend"] for r in results] == ["shm", "tcp"]
    for r in results:
        assert r["verified"] is True and r["block_size"] == 64 << 10 and r["blocks_per_pull"] == 4
        assert r["bytes"] == 4 << 20 and r["pulls"] == 4 and r["gbps"] > 0
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]
    assert "link over 'shm'" in out.stderr and "link over 'tcp'" in out.stderr  # each pair really used its backend
    bars = [ln for ln in out.stderr.splitlines() if ln.startswith("[#") or ln.startswith("[.")]
    assert bars and bars[-1].startswith("[" + "#" * 30 + "] 100.0%")


def test_bench_table() -> None:
    out = kvbroker("bench", "--backends", "tcp", "--block-size", "16K,128K", "--total-bytes", "2M", "--pull-bytes",
                   "512K", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    header, *rows = out.stdout.splitlines()
    assert header.split()[:3] == ["BACKEND", "BLOCK", "TENSORS"] and header.split()[-1] == "VERIFIED"
    assert [r.split()[:3] for r in rows] == [["tcp", "16", "KiB"], ["tcp", "128", "KiB"]]
    assert all(r.split()[-1] == "yes" for r in rows)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_bench_metrics_move_while_it_runs() -> None:
    """What the README promises a newcomer: scrape the bench's daemon and watch the byte counter grow."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvbroker._cli", "bench", "--backends", "tcp", "--block-size",
                             "64K", "--total-bytes", "1G", "--pull-bytes", "8M", "--metrics-listen",
                             f"127.0.0.1:{port}", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[float] = []

    def two_counts_or_ended() -> bool:
        if proc.poll() is not None:
            return True  # the bench ended: the assertion below says what was seen
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return False  # not listening yet
        moved = sum(float(v) for v in re.findall(
            r'^kvbroker_transfer_bytes_total\{[^}]*outcome="DONE"[^}]*\} (\S+)$', text, re.MULTILINE))
        if moved > 0:
            seen.append(moved)
        return len(set(seen)) >= 2

    try:
        wait_until(two_counts_or_ended, timeout=60, poll=0.1, what="two different byte counts scraped")
    finally:
        # Ctrl-C, as a person would: the CLI stops its two daemons on the way out (SIGKILL would orphan them).
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert len(set(seen)) >= 2 and seen == sorted(seen), seen  # the counter grew between two scrapes


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_of_bench_says_interrupted_and_stops_its_daemons() -> None:
    """Ctrl-C in a terminal signals the whole process group: the bench's daemons stop at the same moment, and the
    call in flight fails. The CLI must still say it was interrupted (exit 130), not report that failure."""
    proc = subprocess.Popen([sys.executable, "-m", "kvbroker._cli", "bench", "--backends", "tcp", "--block-size", "64K",
                             "--total-bytes", "8G", "--pull-bytes", "4M"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    try:
        seen = []

        def progress_or_end() -> bool:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            seen.append(line)
            return not line or (line.startswith("[") and "%" in line)

        wait_until(progress_or_end, timeout=60, poll=0, what="pulls running: the first progress line")
        assert any("link over 'tcp'" in s for s in seen), seen
        daemons = _children(proc.pid)
        assert len(daemons) == 2
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("interrupted") and "error:" not in err and "hint:" not in err, err
    assert not [pid for pid in daemons if _running(pid)]


def test_status_on_a_peer_port_says_it_is_a_peer_port(env: Env) -> None:
    out = kvbroker("status", "--target", env.local.peer_address)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"error: {env.local.peer_address} is a kvbrokerd peer port (daemon to daemon), not its local API",
        "hint: give --target the daemon's --listen address: its unix socket (default "
        "unix:///run/kvbroker/kvbroker.sock) or the host:port of a TCP local API"]


def test_every_command_and_option_explains_itself() -> None:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert command.description, f"`kvbroker {name} --help` has no description"
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"`kvbroker {name}` option {action.option_strings} has no help"


def test_small_rates_are_not_rounded_to_zero() -> None:
    assert [fmt_gbps(x) for x in (0.0, 0.0031, 0.000012, 0.01, 3.14159, 12.0)] == [
        "0.00", "0.0031", "0.000012", "0.01", "3.14", "12.00"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(written: str) -> list[str]:
    """The lines a terminal shows: CR moves to the line start, ESC[K erases to its end, text overwrites."""
    lines: list[str] = []
    line, col = "", 0
    for token in re.split(r"(\r|\n|\x1b\[K)", written):
        if token == "\n":
            lines, line, col = [*lines, line], "", 0
        elif token == "\r":
            col = 0
        elif token == "\x1b[K":
            line = line[:col]
        else:
            line, col = line[:col] + token + line[col + len(token):], col + len(token)
    return [*lines, line] if line else lines


def test_bench_notes_and_the_progress_bar_do_not_run_together() -> None:
    term = _Terminal()
    progress = Progress(term, 100)
    progress.note("[bench] shm: daemons up")
    progress.advance(40, "shm 64 KiB blocks")
    progress.note("[bench] tcp: daemons up")
    progress.advance(60, "tcp 64 KiB blocks")
    progress.close()
    screen = _screen(term.getvalue())
    assert screen[:3] == ["[bench] shm: daemons up", "[bench] tcp: daemons up",
                          "[" + "#" * 30 + "] 100.0%  tcp 64 KiB blocks"], screen


def test_bench_failures_do_not_point_at_a_target_it_never_used() -> None:
    for command in ("bench", "demo"):
        hint = _hint(LlmStatus.LLM_FAILED, argparse.Namespace(command=command)) or ""
        assert f"`kvbroker {command}` started" in hint and "/run/kvbroker" not in hint
