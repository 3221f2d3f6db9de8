"""Two "nodes" on this host: daemon A with the prefill worker P next to it, daemon B with the decode worker D.

Each worker is its own OS process and talks only to its own daemon; the driver (this module) routes requests the
way a serving router would: prompt to P, P's handoff to D, D's answer back, then tells P to free the blocks.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from examples.pd_generation.lines import Message
from examples.pd_generation.model import tiny_llama_config
from kvbroker._local import LocalDaemon

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerError(RuntimeError):
    """A worker exited; the message holds the end of its log."""


class Worker:
    """A worker child process (`python -m examples.pd_generation.<module>`), one JSON line per request and answer."""

    def __init__(self, module: str, args: Sequence[str], log_path: Path) -> None:
        self.name, self.log_path = module, log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", f"examples.pd_generation.{module}", *args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT,
                                         text=True)

    def read(self) -> Message:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise WorkerError(f"{self.name} worker exited with {self.proc.wait()}:\n{tail}")
        msg: Message = json.loads(line)
        return msg

    def call(self, **request: Any) -> Message:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        return self.read()

    def close_stdin(self) -> None:
        """Asks the worker to finish: it frees its cache and exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self, timeout: float = 30.0) -> int:
        """Closes stdin and waits for the worker to exit; kills it if it does not."""
        self.close_stdin()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Disaggregated:
    """One request served by P and D: what D produced, and what it took to move the KV."""

    tokens: list[int]
    logits: np.ndarray
    kv_hashes: list[str]
    prefill_kv_hashes: list[str]
    src_blocks: list[int]
    dst_blocks: list[int]
    bytes_moved: int
    pull_s: float
    backend: str


class Deployment:
    """Starts the two daemons and the two workers; `generate()` serves one request through them."""

    def __init__(self, workdir: Path, dtype: str = "fp32", *, backends: Sequence[str] = ("shm", "tcp"),
                 seed: int = 0, first_cluster_id: int = 1) -> None:
        self.workdir, self.dtype, self.seed = Path(workdir), dtype, seed
        self.node_a = LocalDaemon(self.workdir, first_cluster_id, backends=backends)
        self.node_b = LocalDaemon(self.workdir, first_cluster_id + 1, backends=backends)
        self.workers: list[Worker] = []
        self.weight_hashes: dict[str, str] = {}
        self._requests = 0

    def start(self) -> Deployment:
        try:
            self.node_a.start()
            self.node_b.start()
            common = ["--dtype", self.dtype, "--seed", str(self.seed)]
            # Both workers spend seconds importing torch: start them together and wait for both.
            self.prefill = Worker("prefill", ["--kvbroker", self.node_a.target, *common],
                                  self.workdir / f"prefill-{self.node_a.cluster_id}.log")
            self.workers.append(self.prefill)
            self.decode = Worker("decode", ["--kvbroker", self.node_b.target, *common],
                                 self.workdir / f"decode-{self.node_b.cluster_id}.log")
            self.workers.append(self.decode)
            for w in self.workers:
                self.weight_hashes[w.name] = w.read()["weight_hash"]
            if len(set(self.weight_hashes.values())) != 1:
                raise WorkerError(f"the workers built different weights: {self.weight_hashes}")
        except BaseException:
            self.stop()
            raise
        return self

    def generate(self, prompt: Sequence[int], steps: int = 24, *, layer_split: bool = False,
                 fault: str | None = None) -> Disaggregated:
        """P prefills `prompt` (choosing the first token), D pulls the KV and decodes `steps` more tokens."""
        self._requests += 1
        rid = f"r{self._requests}"
        handoff = self.prefill.call(op="prefill", id=rid, prompt=list(prompt))["handoff"]
        try:
            out = self.decode.call(op="decode", id=rid, handoff=handoff, steps=steps, layer_split=layer_split,
                                   fault=fault)
        finally:
            self.prefill.call(op="release", id=rid)
        vocab = tiny_llama_config().vocab_size
        logits = np.frombuffer(base64.b64decode(out["logits"]), dtype="<f4").reshape(-1, vocab)
        return Disaggregated(tokens=[handoff["first_token"], *out["tokens"]], logits=logits,
                             kv_hashes=out["kv_hashes"], prefill_kv_hashes=handoff["kv_hashes"],
                             src_blocks=handoff["block_table"], dst_blocks=out["dst_blocks"],
                             bytes_moved=out["bytes_moved"], pull_s=out["pull_s"], backend=out["backend"])

    def stop(self) -> None:
        """Stops the workers (each frees its cache), then the daemons; raises if a worker or daemon failed."""
        for w in self.workers:
            w.close_stdin()  # first to all: a worker takes a second to exit (interpreter teardown)
        codes: dict[str, int | None] = {w.name: w.close() for w in self.workers}
        self.workers.clear()
        codes |= {f"kvbrokerd {d.cluster_id}": d.stop() for d in (self.node_b, self.node_a)}
        failed = {name: code for name, code in codes.items() if code not in (0, None)}
        if failed:
            raise WorkerError(f"exited with errors: {failed}")

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
