"""What a transfer moves and what landed of it: the contract between the transfer manager (`transfers/`) and the
data-plane engines (`backends/`), below both.

A `Plan` is arrays of byte runs between two caches' tensors (a run may be strided: one entry repeated at a fixed
step); `Pieces` are a plan's runs as an engine cuts them (per thread, per request, per chunk); `Progress` records, from
any thread, which runs (or pieces of runs) landed, and turns that into the destination blocks that did not.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvbrokerd.dataplane.pairs import BlockPairs

Run = tuple[int, int, int, int, int, int]
"""(run index, src tensor, src offset, dst tensor, dst offset, length), as plain ints for copy loops; a piece of a
split run keeps its run's index."""


@dataclass(frozen=True)
class Plan:
    """Byte runs: run i copies `length[i]` bytes from (src_tensor[i], src_offset[i]) to (dst_tensor[i],
    dst_offset[i]). Offsets are relative to the start of the tensor."""

    src_tensor: np.ndarray
    src_offset: np.ndarray
    dst_tensor: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    dst_blocks: np.ndarray
    """Destination blocks touched (for failure reports)."""
    block_nbytes: int
    count: np.ndarray | None = None
    """Strided plans only: entry i copies its `length[i]` bytes `count[i]` times, repetition k from src_offset[i] +
    k * src_stride[i] to dst_offset[i] + k * dst_stride[i] (bytes). None: every count is 1 (a plain plan)."""
    src_stride: np.ndarray | None = None
    dst_stride: np.ndarray | None = None
    dst_pairs: BlockPairs | None = None
    """When set, the destination blocks are these pairs' (and `dst_blocks` is empty): a request that came as runs
    has its blocks written out only if a report needs them (2^17 of them cost ~0.5-1.5 ms per pull)."""

    @property
    def strided(self) -> bool:
        return self.count is not None

    def destination_blocks(self) -> np.ndarray:
        """Destination blocks touched (for failure reports)."""
        return self.dst_blocks if self.dst_pairs is None else self.dst_pairs.dst

    @functools.cached_property
    def num_dst_blocks(self) -> int:
        return len(self.dst_blocks) if self.dst_pairs is None else self.dst_pairs.num_pairs

    @functools.cached_property
    def num_runs(self) -> int:
        """Entries (a strided entry is one, whatever its count): the length of the arrays."""
        return len(self.length)

    @functools.cached_property
    def num_copies(self) -> int:
        """Byte runs copied, a strided entry's repetitions each counted (what a transfer reports as its runs)."""
        return self.num_runs if self.count is None else int(self.count.sum())

    @functools.cached_property
    def run_bytes(self) -> np.ndarray:
        """Bytes per entry (length x count)."""
        return self.length if self.count is None else self.length * self.count

    @functools.cached_property
    def total_bytes(self) -> int:
        # Asked several times per transfer (limits, inline choice, accounting); the arrays never change.
        return int(self.run_bytes.sum())

    def plain(self) -> Plan:
        """The same copies with every repetition written out as a run of its own (for backends that move plain
        runs only: tcp, nixl, hccl). Itself when not strided."""
        if self.count is None or self.src_stride is None or self.dst_stride is None:
            return self
        rep = self.count.astype(np.int64)
        k = (np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)).astype(np.uint64)
        return Plan(src_tensor=np.repeat(self.src_tensor, rep),
                    src_offset=np.repeat(self.src_offset, rep) + k * np.repeat(self.src_stride, rep),
                    dst_tensor=np.repeat(self.dst_tensor, rep),
                    dst_offset=np.repeat(self.dst_offset, rep) + k * np.repeat(self.dst_stride, rep),
                    length=np.repeat(self.length, rep), dst_blocks=self.dst_blocks, block_nbytes=self.block_nbytes,
                    dst_pairs=self.dst_pairs)


@dataclass(frozen=True)
class Pieces:
    """A plan's runs as arrays, possibly cut into pieces (a piece keeps its run's index in `run`). A strided plan's
    pieces carry its counts and strides; a strided entry is cut between repetitions, never inside one."""

    run: np.ndarray
    src_tensor: np.ndarray
    src_offset: np.ndarray
    dst_tensor: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    count: np.ndarray | None = None
    src_stride: np.ndarray | None = None
    dst_stride: np.ndarray | None = None
    first_repeat: np.ndarray | None = None
    """Strided plans only: the repetition of its run that each piece starts at."""

    @classmethod
    def of(cls, plan: Plan) -> Pieces:
        first = None if plan.count is None else np.zeros(plan.num_runs, dtype=np.uint64)
        return cls(np.arange(plan.num_runs), plan.src_tensor, plan.src_offset, plan.dst_tensor, plan.dst_offset,
                   plan.length, plan.count, plan.src_stride, plan.dst_stride, first)

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes per piece (length x count)."""
        return self.length if self.count is None else self.length * self.count

    def runs(self) -> list[Run]:
        plain = self.plain()
        return list(zip(plain.run.tolist(), plain.src_tensor.tolist(), plain.src_offset.tolist(),
                        plain.dst_tensor.tolist(), plain.dst_offset.tolist(), plain.length.tolist(), strict=True))

    def plain(self) -> Pieces:
        """Every repetition of a strided piece as a piece of its own (same run index, and its repetition in
        `first_repeat`); itself when not strided."""
        if self.count is None or self.src_stride is None or self.dst_stride is None:
            return self
        rep = self.count.astype(np.int64)
        k = (np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)).astype(np.uint64)
        first = np.zeros(len(self), dtype=np.uint64) if self.first_repeat is None else self.first_repeat
        return Pieces(np.repeat(self.run, rep), np.repeat(self.src_tensor, rep),
                      np.repeat(self.src_offset, rep) + k * np.repeat(self.src_stride, rep),
                      np.repeat(self.dst_tensor, rep),
                      np.repeat(self.dst_offset, rep) + k * np.repeat(self.dst_stride, rep),
                      np.repeat(self.length, rep), first_repeat=np.repeat(first, rep) + k)

    def take(self, index: slice) -> Pieces:
        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index]

        return Pieces(self.run[index], self.src_tensor[index], self.src_offset[index], self.dst_tensor[index],
                      self.dst_offset[index], self.length[index], cut(self.count), cut(self.src_stride),
                      cut(self.dst_stride), cut(self.first_repeat))

    def bounded(self, max_bytes: int) -> Pieces:
        """The same pieces, those over `max_bytes` cut into pieces of at most that (a strided one between
        repetitions, keeping at least one repetition a piece): a copy checks its fence between pieces, so that a
        copy that resumes after its deadline (a frozen daemon) writes at most one piece more."""
        nbytes = self.nbytes
        big = np.flatnonzero(nbytes > np.uint64(max_bytes))
        if not len(big):
            return self
        parts: list[Pieces] = []
        start = 0
        for i in big.tolist():
            if start < i:
                parts.append(self.take(slice(start, i)))
            parts.append(self.take(slice(i, i + 1))._cut(max_bytes))
            start = i + 1
        if start < len(self):
            parts.append(self.take(slice(start, None)))
        return Pieces.concatenated(parts)

    def _cut(self, max_bytes: int) -> Pieces:
        """This one piece as consecutive pieces of at most `max_bytes` (whole repetitions, when strided)."""
        length = int(self.length[0])
        repeats = 1 if self.count is None else int(self.count[0])
        if repeats > 1:
            step = max(1, max_bytes // length)
            k = np.arange(0, repeats, step, dtype=np.uint64)
            assert self.src_stride is not None and self.dst_stride is not None and self.first_repeat is not None
            return Pieces(np.repeat(self.run, len(k)), np.repeat(self.src_tensor, len(k)),
                          self.src_offset[0] + k * self.src_stride[0], np.repeat(self.dst_tensor, len(k)),
                          self.dst_offset[0] + k * self.dst_stride[0], np.repeat(self.length, len(k)),
                          np.minimum(np.uint64(step), np.uint64(repeats) - k), np.repeat(self.src_stride, len(k)),
                          np.repeat(self.dst_stride, len(k)), self.first_repeat[0] + k)

        def same(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.repeat(a, len(at))

        at = np.arange(0, length, max_bytes, dtype=np.uint64)
        return Pieces(np.repeat(self.run, len(at)), np.repeat(self.src_tensor, len(at)), self.src_offset[0] + at,
                      np.repeat(self.dst_tensor, len(at)), self.dst_offset[0] + at,
                      np.minimum(np.uint64(max_bytes), np.uint64(length) - at), same(self.count),
                      same(self.src_stride), same(self.dst_stride), same(self.first_repeat))

    @staticmethod
    def concatenated(parts: Sequence[Pieces]) -> Pieces:
        def join(name: str) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            return None if arrays[0] is None else np.concatenate(arrays)

        run, src_tensor, src_offset, dst_tensor, dst_offset, length = (
            np.concatenate([getattr(p, name) for p in parts])
            for name in ("run", "src_tensor", "src_offset", "dst_tensor", "dst_offset", "length"))
        return Pieces(run, src_tensor, src_offset, dst_tensor, dst_offset, length, join("count"), join("src_stride"),
                      join("dst_stride"), join("first_repeat"))

    def split(self, parts: int) -> list[Pieces]:
        """`parts` lists of about equal bytes, in order; a run that straddles a boundary is cut there (a strided
        one at the repetition the boundary falls in)."""
        nbytes = self.nbytes
        ends = np.cumsum(nbytes, dtype=np.uint64)
        total = int(ends[-1])
        cuts = sorted({total * k // parts for k in range(1, parts)} - {0, total})
        # Only the runs at the cuts change: each part is a slice of the arrays (no pass over every run but the
        # cumulative sum; splits of 10^5 small runs used to cost more than their copy).
        out: list[Pieces] = []
        run, skip = 0, 0  # the next part starts `skip` bytes into run `run`
        for cut in cuts:
            at = int(np.searchsorted(ends, np.uint64(cut), side="right"))
            head = cut - (int(ends[at]) - int(nbytes[at]))  # bytes of run `at` before the cut
            if self.count is not None and int(self.count[at]) > 1:
                head -= head % int(self.length[at])  # whole repetitions only
            out.append(self._part(run, skip, at, head))
            run, skip = at, head
        out.append(self._part(run, skip, len(self), 0))
        return [p for p in out if len(p)]

    def _part(self, first: int, skip: int, last: int, head: int) -> Pieces:
        """Runs [first, last) and the first `head` bytes of run `last`, less the first `skip` bytes of `first` (for
        a strided run, whole repetitions: `skip` and `head` are multiples of its length)."""
        index = slice(first, last + 1 if head else last)

        def own(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index].copy()

        part = Pieces(self.run[index], self.src_tensor[index], self.src_offset[index].copy(),
                      self.dst_tensor[index], self.dst_offset[index].copy(), self.length[index].copy(),
                      own(self.count), own(self.src_stride), own(self.dst_stride), own(self.first_repeat))
        if not len(part):
            return part
        if head:
            part._keep_head(len(part) - 1, head)
        if skip:
            part._drop_head(0, skip)
        if not part.nbytes[0]:  # a cut at a run's start leaves nothing of it here
            return part.take(slice(1, None))
        return part

    def _keep_head(self, i: int, nbytes: int) -> None:
        """Piece i keeps its first `nbytes` bytes."""
        if self.count is not None and int(self.count[i]) > 1:
            self.count[i] = nbytes // int(self.length[i])
        else:
            self.length[i] = nbytes

    def _drop_head(self, i: int, nbytes: int) -> None:
        """Piece i loses its first `nbytes` bytes."""
        if self.count is not None and self.src_stride is not None and self.dst_stride is not None \
                and int(self.count[i]) > 1:
            k = nbytes // int(self.length[i])
            self.src_offset[i] += np.uint64(k) * self.src_stride[i]
            self.dst_offset[i] += np.uint64(k) * self.dst_stride[i]
            self.count[i] -= np.uint64(k)
            if self.first_repeat is not None:
                self.first_repeat[i] += np.uint64(k)
            return
        self.src_offset[i] += np.uint64(nbytes)
        self.dst_offset[i] += np.uint64(nbytes)
        self.length[i] -= np.uint64(nbytes)


class Progress:
    """What landed of a plan, recorded by backends as runs (or pieces of runs) complete, from any thread."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._landed: list[tuple[int, int]] = []  # list.append is atomic: no lock needed between copy threads
        self._landed_arrays: list[tuple[np.ndarray, np.ndarray]] = []
        self._repeats: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # strided: (runs, first repetition, bytes)
        self._untold: list[np.ndarray] = []  # runs marked without saying which repetitions (or taken back)
        self.cancelled = False
        self._wakers: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def mark(self, run_index: int, nbytes: int) -> None:
        self._landed.append((run_index, nbytes))

    def mark_runs(self, runs: np.ndarray, nbytes: np.ndarray, first_repeat: np.ndarray | None = None) -> None:
        """`mark` for many runs (or pieces of runs) at once; negative bytes take marks back (bytes that arrived but
        turned out not to be the source's). `first_repeat`: for pieces of a strided plan, the repetition each starts
        at (its bytes then say how many whole repetitions landed), so that a report names exactly the repetitions
        that did not land."""
        self._landed_arrays.append((runs, nbytes))
        if first_repeat is not None and not bool((nbytes < 0).any()):  # pieces of strided runs: which repetitions
            self._repeats.append((runs, first_repeat, nbytes))
        elif self.plan.count is not None:
            self._untold.append(runs)

    @contextlib.contextmanager
    def on_cancel(self, wake: Callable[[], object]) -> Iterator[None]:
        """While inside, `cancel` also calls `wake` (from the cancelling thread): for a backend that blocks where a
        flag is not looked at (tcp shuts its socket down, which wakes the thread waiting on it). Called at once if
        the transfer is already cancelled."""
        with self._lock:
            self._wakers.append(wake)
        try:
            if self.cancelled:
                wake()
            yield
        finally:
            with self._lock:
                self._wakers.remove(wake)

    def cancel(self) -> None:
        """The caller went away: copy loops stop at their next check, blocked waits are woken now."""
        self.cancelled = True
        with self._lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def _per_run(self) -> np.ndarray:
        """Bytes landed per run (bincount, not np.add.at: the latter costs seconds for 2^20 runs, and a failure
        report must be ready before the caller's deadline)."""
        parts = list(self._landed_arrays)
        if self._landed:
            idx, n = zip(*self._landed, strict=True)
            parts.append((np.asarray(idx, dtype=np.int64), np.asarray(n, dtype=np.int64)))
        if not parts:
            return np.zeros(self.plan.num_runs, dtype=np.int64)
        runs = np.concatenate([r for r, _ in parts])  # one bincount: one per mark would cost marks x runs
        nbytes = np.concatenate([n.astype(np.int64) for _, n in parts])
        # float64 sums are exact below 2^53 bytes per run
        return np.bincount(runs, weights=nbytes, minlength=self.plan.num_runs).astype(np.int64)

    @property
    def bytes_moved(self) -> int:
        return int(self._per_run().sum())

    def _landed_repeats(self, incomplete: np.ndarray, rep: np.ndarray) -> np.ndarray:
        """Of the repetitions of the `incomplete` strided runs (`rep` each, written out in order), which landed
        whole: from the marks that say where their pieces start. A run with a mark that does not (or that takes
        bytes back) counts as landed nowhere."""
        landed = np.zeros(int(rep.sum()) + 1, dtype=np.int64)
        if not self._repeats:
            return landed[:-1] > 0
        plan = self.plan
        at = np.full(plan.num_runs, -1, dtype=np.int64)  # where each incomplete run's repetitions start
        at[incomplete] = np.cumsum(rep) - rep
        runs = np.concatenate([r for r, _, _ in self._repeats]).astype(np.int64)
        first = np.concatenate([f for _, f, _ in self._repeats]).astype(np.int64)
        nbytes = np.concatenate([n for _, _, n in self._repeats]).astype(np.int64)
        untold = np.zeros(plan.num_runs, dtype=bool)
        for r in [*self._untold, np.asarray([i for i, _ in self._landed], dtype=np.int64)]:
            untold[np.asarray(r, dtype=np.int64)] = True
        keep = (at[runs] >= 0) & ~untold[runs] & (nbytes > 0)
        runs, first, nbytes = runs[keep], first[keep], nbytes[keep]
        whole = nbytes // plan.length[runs].astype(np.int64)
        np.add.at(landed, at[runs] + first, 1)  # marks of a failed transfer's incomplete runs: few
        np.add.at(landed, at[runs] + first + whole, -1)
        return np.cumsum(landed)[:-1] > 0

    def failed_dst_blocks(self) -> np.ndarray:
        """Destination blocks of which at least one tensor's bytes did not (completely) land (every block of a run
        that did not land whole: a strided run's every repetition)."""
        plan = self.plan
        incomplete = self._per_run() < plan.run_bytes.astype(np.int64)
        if not incomplete.any():
            return np.zeros(0, dtype=np.uint64)
        bpb = np.uint64(plan.block_nbytes)
        offset, length = plan.dst_offset[incomplete], plan.length[incomplete]
        if plan.count is not None and plan.dst_stride is not None:  # a failure only: written out here
            rep = plan.count[incomplete].astype(np.int64)
            k = (np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)).astype(np.uint64)
            offset = np.repeat(offset, rep) + k * np.repeat(plan.dst_stride[incomplete], rep)
            length = np.repeat(length, rep)
            missing = ~self._landed_repeats(incomplete, rep)
            offset, length = offset[missing], length[missing]
        starts = (offset // bpb).astype(np.int64)
        ends = ((offset + length + bpb - np.uint64(1)) // bpb).astype(np.int64)
        if not len(starts):
            return np.zeros(0, dtype=np.uint64)
        # Blocks covered by any incomplete run, as a difference array over [0, last end): linear, no sort.
        size = int(ends.max()) + 1
        cover = np.cumsum(np.bincount(starts, minlength=size) - np.bincount(ends, minlength=size))
        return np.flatnonzero(cover[:-1] > 0).astype(np.uint64)
