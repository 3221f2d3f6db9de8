"""Runs docs/vllm.md's shell blocks in order, in one bash shell, as the page tells a user to.

Every ```bash block runs from the repository root in one shell (`set -eo pipefail`: a command that fails fails the
run), one block at a time: after each block the shell records its background jobs and waits for the runner's go. An
HTML comment just before a block says how the runner treats it, so that editing the page keeps the runner right:

    <!-- walkthrough: skip REASON -->    not run (GPU only, ...)
    <!-- walkthrough: install -->        replaced by activating the venv this runner runs in (CI has just made it)
    <!-- walkthrough: expect REGEX -->   the block's output must match REGEX (Python `re`, multiline); repeatable
    <!-- walkthrough: retry SECONDS -->  run again until it succeeds, for up to SECONDS (output that a server writes
                                         later, such as a periodic log line; only for blocks that change nothing)
    <!-- walkthrough: stop -->           the block that stops what the page started

Every process a block starts in the background (servers, daemons, proxies) must keep running until the stop block,
and for at least `SETTLE_S` before it: one that dies fails the run at once, with the tails of the logs the page
writes. The stop block must stop them all within `STOP_GRACE_S`. Whatever happens, the runner then ends the shell's
whole process group (SIGTERM, then SIGKILL), so nothing the page started outlives the run.

The page's ports are its own (the CI machine runs one thing at a time); one that is taken fails the run before any
block runs. By hand: `tests/vllm/.venv/bin/python tests/vllm/walkthrough.py [docs/vllm.md]`.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen
from typing import IO

if not __package__:  # run by hand as a script (see above): the tests package is at the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import comes_true, wait_until

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
DEADLINE_S = 1800.0
SETTLE_S = 60.0
"""A server that cannot start usually dies within seconds; one that lives this long before the stop block ran."""
STOP_GRACE_S = 60.0
LOG_TAIL_LINES = 25

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*walkthrough:\s*(\w+)\s*(.*?)\s*-->\s*$")
_PORT = re.compile(r"(?:localhost|127\.0\.0\.1):(\d{2,5})\b|--port\s+\"?(\d{2,5})\b")
_LOG = re.compile(r">\s*\"?(/tmp/[\w./$-]+\.log)\b")
VERBS = ("skip", "install", "expect", "retry", "stop")


class WalkthroughError(AssertionError):
    pass


@dataclass
class Block:
    line: int
    """1-based line of the opening fence."""
    text: str
    skip: str | None = None
    install: bool = False
    expect: list[str] = field(default_factory=list)
    retry_s: int = 0
    stop: bool = False

    @property
    def runs(self) -> bool:
        return self.skip is None

    def title(self) -> str:
        first = next((s for s in self.text.splitlines() if s.strip()), "")
        return f"block at line {self.line} ({first[:70]})"


def parse(markdown: str) -> list[Block]:
    """The page's bash blocks with the directives of the comments just before each (blank lines may come between)."""
    blocks: list[Block] = []
    pending: list[tuple[str, str]] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        directive = _DIRECTIVE.match(lines[i].strip())
        fence = _FENCE.match(lines[i])
        if directive:
            verb, arg = directive.groups()
            if verb not in VERBS:
                raise WalkthroughError(f"line {i + 1}: unknown walkthrough directive {verb!r} (known: {VERBS})")
            pending.append((verb, arg))
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise WalkthroughError(f"line {i + 1}: code block never closed")
            if fence.group(1) == "bash":
                blocks.append(_block(i + 1, "\n".join(lines[i + 1:end]) + "\n", pending))
            elif pending:
                raise WalkthroughError(f"line {i + 1}: walkthrough directives before a block that is not bash")
            pending = []
            i = end
        elif lines[i].strip() and pending:
            raise WalkthroughError(f"line {i + 1}: walkthrough directives {pending} are not just before a bash block")
        i += 1
    return blocks


def _block(line: int, text: str, directives: list[tuple[str, str]]) -> Block:
    block = Block(line, text)
    for verb, arg in directives:
        if verb == "skip":
            block.skip = arg or "marked skip"
        elif verb == "install":
            block.install = True
        elif verb == "expect":
            re.compile(arg, re.MULTILINE)
            block.expect.append(arg)
        elif verb == "retry":
            block.retry_s = int(arg.split()[0])
        else:
            block.stop = True
    return block


def ports_of(blocks: list[Block]) -> set[int]:
    return {int(a or b) for block in blocks if block.runs for a, b in _PORT.findall(block.text)}


def logs_of(blocks: list[Block]) -> list[str]:
    """The logs the blocks write, as globs (`/tmp/vllm-$name.log` -> `/tmp/vllm-*.log`)."""
    return sorted({re.sub(r"\$\w+", "*", p) for block in blocks if block.runs for p in _LOG.findall(block.text)})


def check_ports_free(ports: set[int]) -> None:
    taken = []
    for port in sorted(ports):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    if taken:
        raise WalkthroughError(f"ports {taken} are in use: the walkthrough needs the ports docs/vllm.md names; "
                               "stop what listens there (ss -ltnp) and run again")


def script(blocks: list[Block], state: Path, venv: Path) -> str:
    """One bash script: each block, then a hand-shake that records its background jobs and waits for the go."""
    parts = ["set -eo pipefail"]
    for n, block in enumerate(blocks):
        if not block.runs:
            continue
        body = f'source "{venv}/bin/activate"\n' if block.install else block.text
        out = f'"{state}/out.{n}"'
        if block.retry_s:
            # A subshell outside any condition, so that `set -e` holds inside it while a failure only retries.
            parts.append(f"walkthrough_until=$((SECONDS + {block.retry_s}))\nwhile :; do\nset +e\n( set -e\n{body})"
                         f" > {out} 2>&1\nwalkthrough_status=$?\nset -e\n[ $walkthrough_status = 0 ] && break\n"
                         "[ $SECONDS -lt $walkthrough_until ] || exit $walkthrough_status\nsleep 2\ndone")
        else:
            parts.append(f"{{\n{body}}} > {out} 2>&1")
        parts.append(f'jobs -p > "{state}/jobs.{n}"; touch "{state}/done.{n}"')
        parts.append(f'until [ -e "{state}/go.{n}" ]; do sleep 0.2; done')
    return "\n".join(parts) + "\n"


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command's name (state, ppid, pgrp, ...); none for a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def alive(pid: int | str) -> bool:
    stat = _stat(pid)
    return bool(stat) and stat[0] != "Z"


def age_s(pid: int) -> float:
    """Seconds since the process started (infinite for one that is gone)."""
    stat = _stat(pid)
    if not stat:
        return float("inf")
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return uptime_s - int(stat[19]) / os.sysconf("SC_CLK_TCK")


def group_members(pgid: int) -> list[int]:
    """The live processes of a process group (zombies waiting for init to reap them are gone already)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and alive(p.name)
            and _stat(p.name)[2:3] == [str(pgid)]]


class Run:
    def __init__(self, blocks: list[Block], state: Path, venv: Path, deadline_s: float, settle_s: float,
                 stop_grace_s: float) -> None:
        self.blocks = blocks
        self.settle_s = settle_s
        self.stop_grace_s = stop_grace_s
        self.state = state
        self.venv = venv
        self.deadline = time.monotonic() + deadline_s
        self.started: dict[int, Block] = {}
        """Background pid -> the block that started it."""
        self.log_paths = logs_of(blocks)
        self.stopping = False

    def run(self) -> None:
        check_ports_free(ports_of(self.blocks))
        path = self.state / "walkthrough.sh"
        path.write_text(script(self.blocks, self.state, self.venv))
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        with open(self.state / "shell.log", "wb") as log, self._shell(path, env, log) as shell:
            previous: int | None = None
            for n, block in enumerate(self.blocks):
                if not block.runs:
                    print(f"walkthrough: skipping {block.title()}: {block.skip}", flush=True)
                    continue
                if block.stop:
                    self._settle(block)
                    self.stopping = True
                self._go(previous)
                previous = n
                began = time.monotonic()
                self._wait_done(shell, n, block)
                out = (self.state / f"out.{n}").read_text(errors="replace")
                print(f"walkthrough: {block.title()} ran in {time.monotonic() - began:.0f} s", flush=True)
                for pattern in block.expect:
                    if not re.search(pattern, out, re.MULTILINE):
                        self._fail(block, f"its output does not match {pattern!r}", out)
                for pid in map(int, (self.state / f"jobs.{n}").read_text().split()):
                    self.started.setdefault(pid, block)
                if block.stop:
                    self._wait_stopped(block)
                else:
                    self._check_alive(block)
            self._go(previous)
            if shell.wait(STOP_GRACE_S) != 0:
                raise WalkthroughError(f"the walkthrough's shell exited with {shell.returncode} after its last block")

    def _go(self, n: int | None) -> None:
        if n is not None:
            (self.state / f"go.{n}").touch()

    @contextmanager
    def _shell(self, path: Path, env: dict[str, str], log: IO[bytes]) -> Iterator[Popen[bytes]]:
        shell = Popen(["bash", str(path)], cwd=ROOT, env=env, stdin=DEVNULL, stdout=log, stderr=STDOUT,
                      start_new_session=True)
        try:
            yield shell
        finally:
            self._end_group(shell)

    def _wait_done(self, shell: Popen[bytes], n: int, block: Block) -> None:
        def done() -> bool:
            if (self.state / f"done.{n}").exists():
                return True
            if shell.poll() is not None:
                out = (self.state / f"out.{n}").read_text(errors="replace")
                self._fail(block, f"it failed (the shell exited with {shell.returncode})", out)
            if not self.stopping:
                self._check_alive(block)
            return False

        if not comes_true(done, within=max(0.0, self.deadline - time.monotonic()), poll=0.5):
            self._fail(block, "the walkthrough ran past its deadline", "")

    def _check_alive(self, running: Block) -> None:
        dead = [(pid, block) for pid, block in self.started.items() if not alive(pid)]
        if dead:
            pid, block = dead[0]
            self._fail(running, f"process {pid}, started in the background by {block.title()}, has exited",
                       self._output(block), f"the output of the {block.title()}")

    def _settle(self, stop: Block) -> None:
        """Gives the youngest background process time to die of a bad start before the stop block ends them all."""
        def all_settled() -> bool:
            self._check_alive(stop)
            return all(age_s(pid) >= self.settle_s for pid in self.started)

        # (the youngest process is settle_s old within settle_s from now: the timeout is never what ends this)
        wait_until(all_settled, timeout=self.settle_s + 5.0, poll=0.5, what="the background processes to settle")

    def _wait_stopped(self, stop: Block) -> None:
        if comes_true(lambda: not any(alive(pid) for pid in self.started), within=self.stop_grace_s, poll=0.5):
            return
        left = [pid for pid in self.started if alive(pid)]
        self._fail(stop, f"processes {left} still run {self.stop_grace_s:.0f} s after it", "")

    def _end_group(self, shell: Popen[bytes]) -> None:
        pgid = shell.pid

        def gone() -> bool:
            shell.poll()  # reaps the shell once it has exited
            return not group_members(pgid)

        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            with suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            if comes_true(gone, within=wait_s, poll=0.5):
                return

    def _output(self, block: Block) -> str:
        path = self.state / f"out.{self.blocks.index(block)}"
        return path.read_text(errors="replace") if path.exists() else ""

    def _fail(self, block: Block, why: str, out: str, out_is: str = "its output") -> None:
        report = [f"docs/vllm.md walkthrough: {block.title()}: {why}", "--- the block:", block.text.rstrip()]
        if out:
            report += [f"--- {out_is}:", _tail(out)]
        for log in sorted({p for pattern in self.log_paths for p in glob.glob(pattern)}):
            report += [f"--- {log}:", _tail(Path(log).read_text(errors="replace"))]
        raise WalkthroughError("\n".join(report))


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


def run_walkthrough(doc: Path = DOC, venv: Path = Path(sys.prefix), deadline_s: float = DEADLINE_S,
                    settle_s: float = SETTLE_S, stop_grace_s: float = STOP_GRACE_S) -> None:
    blocks = parse(doc.read_text())
    with tempfile.TemporaryDirectory(prefix="walkthrough-") as state:
        Run(blocks, Path(state), venv, deadline_s, settle_s, stop_grace_s).run()


if __name__ == "__main__":
    started = time.monotonic()
    run_walkthrough(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
    print(f"walkthrough: every block ran as the page says, in {time.monotonic() - started:.0f} s")
