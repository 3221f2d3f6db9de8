"""`kvbroker`: the operator CLI.

    kvbroker status|caches|links --target ADDR        the daemon's identity and counts, caches, links (tables)
    kvbroker link   --target ADDR --cluster N --address HOST:PORT      link the daemon at ADDR to cluster N
    kvbroker unlink --target ADDR --cluster N [--address HOST:PORT] [--force]
    kvbroker pull   --target ADDR --src-cluster N --src-cache ID --dst-cache ID --src-blocks 0,1,2 --dst-blocks 5-7
                    [--layers a:b] [--dst-layers c:d] [--tensors-per-layer 2]    one pull, for debugging
    kvbroker bench  [--backends shm,tcp] [--block-size 64K,1M] [--total-bytes 512M] [--json]
                    [--metrics-listen 127.0.0.1:9100]       quick pull benchmark between two local daemons
    kvbroker demo

`--target` is `unix:///path/to/kvbroker.sock` (a bare absolute path works too) or `host:port`. A failure prints the
LLM status name, the daemon's message and a one-line hint, and exits 1 (2 for a bad command line, 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from kvbroker._bench import BenchError, Progress, plan_bench, render_bench, run_bench
from kvbroker._client import Client
from kvbroker._format import fmt_gbps, fmt_size, table
from kvbroker._local import default_backends
from kvbroker.status import LlmError, LlmStatus
from kvbroker.types import CacheIndex, ClusterInfo, ClusterResult, KvCacheExtParam

DEFAULT_TARGET = "unix:///run/kvbroker/kvbroker.sock"
_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
               "G": 2**30, "GB": 2**30, "GIB": 2**30}


# ----------------------------------------------------------------------------------------------- argument types


def parse_target(value: str) -> str:
    """`unix:///path`, a bare absolute path (taken as a unix socket) or `host:port`."""
    if value.startswith("/"):
        return "unix://" + value
    if value.startswith("unix:"):
        return value
    host, sep, port = value.rpartition(":")
    if sep and host and port.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither unix:///path nor host:port")


def parse_blocks(value: str) -> list[int]:
    """`0,1,2`, with inclusive ranges: `0-3,8` = 0,1,2,3,8."""
    out: list[int] = []
    for item in value.split(","):
        item = item.strip()
        first, dash, last = item.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise argparse.ArgumentTypeError(f"{value!r}: blocks are non-negative integers or ranges a-b, "
                                             "separated by commas")
        if dash and int(last) < int(first):
            raise argparse.ArgumentTypeError(f"{item!r}: empty range")
        out.extend(range(int(first), int(last if dash else first) + 1))
    return out


def parse_layers(value: str) -> tuple[int, int]:
    """`a:b` (inclusive layer range), `a` (one layer) or `all` (= -1:-1)."""
    if value.strip().lower() == "all":
        return (-1, -1)
    first, colon, last = value.partition(":")
    try:
        rng = (int(first), int(last if colon else first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a layer range a:b") from None
    return rng


def parse_size(value: str) -> int:
    """`4096`, `64K`, `1M`, `2G`, `1.5G` (binary units)."""
    text = value.strip().upper()
    digits = text.rstrip("KMGIB")
    unit = text[len(digits):]
    try:
        size = int(float(digits) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a size such as 4096, 64K, 1M or 2G") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a size must be > 0")
    return size


def parse_sizes(value: str) -> list[int]:
    return [parse_size(v) for v in value.split(",") if v.strip()]


def parse_backends(value: str) -> list[str]:
    """Backend names (the daemons refuse, by name, one they do not know or cannot run here)."""
    backends = [b.strip() for b in value.split(",") if b.strip()]
    if not backends or not all(b.replace("_", "").replace("-", "").isalnum() for b in backends):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated list of backend names, e.g. shm,tcp")
    return backends


# -------------------------------------------------------------------------------------------------- hints


def _hint(status: LlmStatus, args: argparse.Namespace) -> str | None:
    target = getattr(args, "target", DEFAULT_TARGET)
    cluster = getattr(args, "src_cluster", None) or getattr(args, "cluster", None) or "N"
    if status == LlmStatus.LLM_NOT_YET_LINK and args.command == "unlink":
        return f"nothing to unlink: `kvbroker links --target {target}` lists the links"
    if status == LlmStatus.LLM_FAILED and args.command in ("bench", "demo"):
        # These talk only to daemons they started themselves: no --target to check.
        return f"a daemon that `kvbroker {args.command}` started stopped answering; is /dev/shm (or memory) full?"
    hints: dict[LlmStatus, str] = {
        LlmStatus.LLM_NOT_YET_LINK: f"run `kvbroker link --target {target} --cluster {cluster} --address HOST:PORT` "
                                    "first (HOST:PORT = the remote daemon's PEER ADDRESS in its `kvbroker status`)",
        LlmStatus.LLM_KV_CACHE_NOT_EXIST: "check the cache ids with `kvbroker caches --target ...` on both daemons "
                                          "(ids change when a daemon restarts)",
        LlmStatus.LLM_PARAM_INVALID: "check blocks against the caches' block counts (`kvbroker caches`: shape[0]) "
                                     "and layer ranges against num_tensors / --tensors-per-layer",
        LlmStatus.LLM_ALREADY_LINK: f"already linked (`kvbroker links --target {target}`); "
                                    "`kvbroker unlink` first to link again",
        LlmStatus.LLM_LINK_FAILED: "can this daemon reach --address? it must be the remote daemon's peer address "
                                   "(`kvbroker status` there), not its unix socket",
        LlmStatus.LLM_UNLINK_FAILED: "the remote daemon did not answer; `kvbroker unlink --force` drops the link "
                                     "locally",
        LlmStatus.LLM_EXIST_LINK: f"links still use it; see `kvbroker links --target {target}` and unlink first",
        LlmStatus.LLM_TIMEOUT: f"raise --timeout, or look for a BROKEN link in `kvbroker links --target {target}`",
        LlmStatus.LLM_WAIT_PROC_TIMEOUT: "raise --timeout, or look for a BROKEN link in `kvbroker links`",
        LlmStatus.LLM_LINK_BUSY: "another link or unlink of this cluster is in progress; retry in a moment",
        LlmStatus.LLM_PROCESSING_LINK: "another link or unlink of this cluster is in progress; retry in a moment",
        LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT: "at most 16 clusters per call",
        LlmStatus.LLM_OUT_OF_MEMORY: "the daemon is out of memory or cache slots (--max-caches, /dev/shm size)",
        LlmStatus.LLM_FEATURE_NOT_ENABLED: "this daemon does not support that (check its --backends and version "
                                           "with `kvbroker status`)",
        LlmStatus.LLM_FAILED: f"is kvbrokerd running and listening at {target}? (`kvbroker status --target ...`; "
                              "its log says more)",
    }
    return hints.get(status)


def _report(status: LlmStatus, message: str, args: argparse.Namespace, err: TextIO) -> None:
    print(f"error: {status.name}: {message}", file=err)
    hint = _hint(status, args)
    if hint:
        print(f"hint: {hint}", file=err)


def _not_the_local_api(e: LlmError) -> bool:
    """UNIMPLEMENTED from gRPC itself (no kvbroker ErrorInfo): nothing at the target serves kvbroker.v1.KvBroker."""
    return e.details.get("grpc_code") == "UNIMPLEMENTED" and "status_code" not in e.details


def _serves_peer_api(target: str, timeout: float) -> bool:
    """Whether `target` is a kvbrokerd peer port: its health service knows kvbroker.v1.Peer."""
    import grpc

    # HealthCheckRequest{service: "kvbroker.v1.Peer"} encoded by hand: the client does not depend on grpc_health.
    service = b"kvbroker.v1.Peer"
    request = b"\x0a" + bytes([len(service)]) + service
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=None)
        try:
            check(request, timeout=timeout)
        except grpc.RpcError:
            return False
    return True


def _report_wrong_target(args: argparse.Namespace, err: TextIO) -> None:
    target = args.target
    if _serves_peer_api(target, min(args.timeout, 5.0)):
        print(f"error: {target} is a kvbrokerd peer port (daemon to daemon), not its local API", file=err)
    else:
        print(f"error: {target} does not serve the kvbroker local API (kvbroker.v1.KvBroker)", file=err)
    print("hint: give --target the daemon's --listen address: its unix socket (default "
          f"{DEFAULT_TARGET}) or the host:port of a TCP local API", file=err)


# ------------------------------------------------------------------------------------------ table commands


def _status(args: argparse.Namespace) -> int:
    with Client(args.target, timeout=args.timeout) as c:
        info = c.get_cluster_info()
    print(table([[str(info.cluster_id), info.version, info.peer_address, ",".join(info.backends),
                  str(info.num_caches), str(info.num_links), info.instance_epoch]],
                ["CLUSTER", "VERSION", "PEER ADDRESS", "BACKENDS", "CACHES", "LINKS", "EPOCH"]))
    return 0


def _caches(args: argparse.Namespace) -> int:
    with Client(args.target, timeout=args.timeout) as c:
        caches = c.list_caches()
    print(table([[str(r.cache_id), str(r.desc.num_tensors), "x".join(map(str, r.desc.shape)), r.desc.data_type.name,
                  f"{r.desc.tensor_nbytes * r.desc.num_tensors / 2**20:.1f}",
                  "daemon" if r.daemon_owned else "caller"] for r in caches],
                ["ID", "TENSORS", "SHAPE", "DTYPE", "MIB", "MEMORY"]))
    return 0


def _links(args: argparse.Namespace) -> int:
    with Client(args.target, timeout=args.timeout) as c:
        links = c.list_links()
    print(table([[str(link.remote_cluster_id), link.remote_address, link.state.name, link.backend, link.reason]
                 for link in links], ["CLUSTER", "ADDRESS", "STATE", "BACKEND", "REASON"]))
    return 0


# ------------------------------------------------------------------------------------------- link / unlink


def _cluster_results(results: list[ClusterResult], args: argparse.Namespace, verb: str) -> int:
    failed = 0
    for r in results:
        if r.ok:
            print(f"{verb} cluster {r.remote_cluster_id}: {r.status.name}")
        else:
            failed += 1
            _report(r.status, r.message or f"cluster {r.remote_cluster_id}", args, sys.stderr)
    return 1 if failed else 0


def _link(args: argparse.Namespace) -> int:
    with Client(args.target, timeout=args.timeout) as c:
        results = c.link_clusters([ClusterInfo(args.cluster, args.address)], timeout=args.timeout)
        code = _cluster_results(results, args, "linked")
        if code == 0:
            for link in c.list_links():
                if link.remote_cluster_id == args.cluster:
                    print(f"  {link.state.name} over {link.backend or '?'} to {link.remote_address}")
    return code


def _unlink(args: argparse.Namespace) -> int:
    with Client(args.target, timeout=args.timeout) as c:
        address = args.address
        if not address:  # the daemon matches on the cluster id; fill the address in from the link table
            address = next((link.remote_address for link in c.list_links() if link.remote_cluster_id == args.cluster),
                           "")
        results = c.unlink_clusters([ClusterInfo(args.cluster, address)], force=args.force, timeout=args.timeout)
    return _cluster_results(results, args, "unlinked")


# ---------------------------------------------------------------------------------------------------- pull


def _ext_param(args: argparse.Namespace) -> KvCacheExtParam | None:
    src, dst = args.layers, args.dst_layers
    if src is None and dst is None and args.tensors_per_layer is None:
        return None
    src = src if src is not None else (dst if dst is not None else (-1, -1))
    dst = dst if dst is not None else src
    return KvCacheExtParam(src_layer_range=src, dst_layer_range=dst,
                           tensor_num_per_layer=2 if args.tensors_per_layer is None else args.tensors_per_layer)


def _pull(args: argparse.Namespace) -> int:
    ext = _ext_param(args)
    with Client(args.target, timeout=args.timeout) as c:
        t0 = time.perf_counter()
        result = c.pull_kv_blocks(CacheIndex(args.src_cluster, args.src_cache), args.dst_cache, args.src_blocks,
                                  args.dst_blocks, ext)
        elapsed = time.perf_counter() - t0
    gbps = result.bytes_moved / elapsed / 1e9 if elapsed > 0 else 0.0
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "seconds": elapsed, "gbps": gbps}))
        return 0
    print(table([[result.transfer_id, str(result.bytes_moved), fmt_size(result.bytes_moved), result.backend,
                  str(result.num_runs), f"{elapsed * 1e3:.2f}", fmt_gbps(gbps)]],
                ["TRANSFER ID", "BYTES", "SIZE", "BACKEND", "RUNS", "MS", "GB/S"]))
    return 0


# --------------------------------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    if args.backends is None:
        args.backends = default_backends()
    points = plan_bench(args.backends, args.block_size, args.total_bytes, args.tensors, args.pull_bytes)
    total = sum(p.pulls * p.bytes_per_pull for p in points)
    progress = Progress(sys.stderr, total, enabled=not args.no_progress)

    def log(msg: str) -> None:
        progress.note(f"[bench] {msg}")

    log(f"{len(points)} point(s), {fmt_size(total)} in all; each pull moves every block of a cache of "
        f"{args.tensors} tensors in a random order")
    try:
        run_bench(points, progress, timeout=args.timeout, seed=args.seed, log=log, metrics_listen=args.metrics_listen)
    finally:
        progress.close()
    if args.json:
        print(json.dumps({"config": {"backends": args.backends, "block_sizes": args.block_size,
                                     "total_bytes": args.total_bytes, "tensors": args.tensors,
                                     "pull_bytes": args.pull_bytes, "seed": args.seed},
                          "results": [p.summary() for p in points]}, indent=2))
    else:
        print(render_bench(points))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvbroker._demo import run_demo

    run_demo(layers=args.layers, blocks=args.blocks, backends=tuple(args.backends) if args.backends else None)
    return 0


# ---------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbroker", description="kvbroker operator CLI",
                                     epilog="--target: unix:///path/to/kvbroker.sock (default "
                                     f"{DEFAULT_TARGET}) or host:port")
    sub = parser.add_subparsers(dest="command", required=True)

    def target_parser(name: str, fn: Callable[[argparse.Namespace], int], text: str,
                      timeout: float = 5.0) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--target", type=parse_target, default=DEFAULT_TARGET,
                       help=f"daemon address: unix:///path or host:port (default {DEFAULT_TARGET})")
        p.add_argument("--timeout", type=float, default=timeout, help=f"seconds (default {timeout})")
        p.set_defaults(fn=fn)
        return p

    target_parser("status", _status, "the daemon's identity and counts")
    target_parser("caches", _caches, "the daemon's caches")
    target_parser("links", _links, "the daemon's links")

    p = target_parser("link", _link, "link the daemon at --target to a remote cluster (it dials --address)")
    p.add_argument("--cluster", type=int, required=True, help="the remote cluster id")
    p.add_argument("--address", required=True, help="the remote daemon's peer address host:port")
    p = target_parser("unlink", _unlink, "unlink the daemon at --target from a remote cluster")
    p.add_argument("--cluster", type=int, required=True, help="the remote cluster id")
    p.add_argument("--address", default="", help="the remote peer address (default: from the link table)")
    p.add_argument("--force", action="store_true", help="drop the link even if the remote daemon does not answer")

    p = target_parser("pull", _pull, "one PullKvBlocks from a cache of a linked cluster into a local cache "
                      "(for debugging); prints the TransferResult", timeout=30.0)
    p.add_argument("--src-cluster", type=int, required=True, help="the source cache's cluster id")
    p.add_argument("--src-cache", type=int, required=True, help="the source cache's id on its daemon")
    p.add_argument("--dst-cache", type=int, required=True, help="the local destination cache id")
    p.add_argument("--src-blocks", type=parse_blocks, required=True, help="e.g. 0,1,2 or 0-2,8")
    p.add_argument("--dst-blocks", type=parse_blocks, required=True, help="as many blocks as --src-blocks")
    p.add_argument("--layers", type=parse_layers, help="source layer range a:b (inclusive) or all; "
                   "--dst-layers defaults to the same range")
    p.add_argument("--dst-layers", type=parse_layers, help="destination layer range c:d (default: --layers)")
    p.add_argument("--tensors-per-layer", type=int, help="tensors per layer (default 2: K and V)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")

    p = sub.add_parser("bench", help="quick pull benchmark between two local daemons (progress on stderr, a "
                       "summary table at the end)",
                       description="Starts two local daemons per backend, links them, and times PullKvBlocks of "
                       "every block of a cache in a random order until --total-bytes moved (after a verified "
                       "warm-up pull). The full comparison with memcpy, sockets, NIXL and Mooncake is "
                       "bench/kvbench.py in a source checkout.")
    p.add_argument("--backends", type=parse_backends, default=None,
                   help="backends to measure, one daemon pair each (default: the daemon's default backends, shm,tcp)")
    p.add_argument("--block-size", type=parse_sizes, default=[256 * 2**10],
                   help="bytes per block per tensor; a comma list measures each (default 256K)")
    p.add_argument("--total-bytes", type=parse_size, default=512 * 2**20,
                   help="bytes moved per backend and block size (default 512M)")
    p.add_argument("--tensors", type=int, default=16, help="tensors per cache (default 16: 8 layers of K, V)")
    p.add_argument("--pull-bytes", type=parse_size, default=64 * 2**20,
                   help="bytes per pull, i.e. cache size (default 64M)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each call, seconds (default 120)")
    p.add_argument("--seed", type=int, default=7, help="seed of the cache contents and block orders (default 7)")
    p.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                   help="serve the pulling daemon's Prometheus metrics there while the bench runs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or log lines on stderr")
    p.set_defaults(fn=_bench)

    p = sub.add_parser("demo", help="two local daemons, a real verified pull, and its throughput",
                       description="Starts a prefill and a decode daemon on this host, links them, pulls half the "
                       "layers of scattered blocks from one cache into the other, checks every byte, prints the "
                       "throughput, and stops both daemons leaving nothing behind. Needs `kvbroker[server]`.")
    p.add_argument("--layers", type=int, default=8, help="layers per cache, each a K and a V tensor (default 8)")
    p.add_argument("--blocks", type=int, default=256, help="blocks per cache of 16 tokens x 8 heads x 128 fp16 "
                   "(default 256)")
    p.add_argument("--backends", type=parse_backends, default=None,
                   help="backend order for both daemons, e.g. tcp (default: the daemon's default order, shm,tcp)")
    p.set_defaults(fn=_demo)
    return parser


_interrupted = threading.Event()


def _on_sigint(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "pull" and len(args.src_blocks) != len(args.dst_blocks):
        parser.error(f"--src-blocks has {len(args.src_blocks)} blocks, --dst-blocks {len(args.dst_blocks)}")
    if args.command == "bench" and (args.tensors < 1 or args.timeout <= 0):
        parser.error("--tensors must be >= 1 and --timeout > 0")
    # Ctrl-C in a terminal reaches the whole process group: `bench` and `demo` daemons stop too, and the call that
    # was waiting on one may fail (UNAVAILABLE) before KeyboardInterrupt is raised. The flag says what happened.
    with contextlib.suppress(ValueError):  # not the main thread (main() called from a program): nothing to do
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        code: int = args.fn(args)
    except KeyboardInterrupt:
        code = 130
    except LlmError as e:
        if _interrupted.is_set():
            code = 130
        elif _not_the_local_api(e):
            _report_wrong_target(args, sys.stderr)
            return 1
        else:
            _report(e.status, e.message, args, sys.stderr)
            return 1
    except (BenchError, RuntimeError) as e:
        if not _interrupted.is_set():
            print(f"error: {e}", file=sys.stderr)
            return 1
        code = 130
    if code == 130 or _interrupted.is_set():
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
