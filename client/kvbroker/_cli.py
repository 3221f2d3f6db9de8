"""`kvbroker`: the operator CLI (demo, status, caches, links)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvbroker._client import Client
from kvbroker._status import LlmError, LlmStatus

DEFAULT_TARGET = "unix:///run/kvbroker/kvbroker.sock"
_HINTS = {
    LlmStatus.LLM_NOT_YET_LINK: "link first: the model server calls link_clusters (see `kvbroker links`)",
    LlmStatus.LLM_KV_CACHE_NOT_EXIST: "list the caches with `kvbroker caches --target ...`",
    LlmStatus.LLM_FAILED: "is kvbrokerd running at --target? (`kvbroker status`)",
}


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])


def _status(args: argparse.Namespace) -> None:
    with Client(args.target, timeout=args.timeout) as c:
        info = c.get_cluster_info()
    print(_table([[str(info.cluster_id), info.version, info.peer_address, ",".join(info.backends),
                   str(info.num_caches), str(info.num_links), info.instance_epoch]],
                 ["CLUSTER", "VERSION", "PEER ADDRESS", "BACKENDS", "CACHES", "LINKS", "EPOCH"]))


def _caches(args: argparse.Namespace) -> None:
    with Client(args.target, timeout=args.timeout) as c:
        caches = c.list_caches()
    print(_table([[str(r.cache_id), str(r.desc.num_tensors), "x".join(map(str, r.desc.shape)), r.desc.data_type.name,
                   f"{r.desc.tensor_nbytes * r.desc.num_tensors / 2**20:.1f}",
                   "daemon" if r.daemon_owned else "caller"] for r in caches],
                 ["ID", "TENSORS", "SHAPE", "DTYPE", "MIB", "MEMORY"]))


def _links(args: argparse.Namespace) -> None:
    with Client(args.target, timeout=args.timeout) as c:
        links = c.list_links()
    print(_table([[str(link.remote_cluster_id), link.remote_address, link.state.name, link.backend, link.reason]
                  for link in links], ["CLUSTER", "ADDRESS", "STATE", "BACKEND", "REASON"]))


def _demo(args: argparse.Namespace) -> None:
    from kvbroker._demo import run_demo

    run_demo(layers=args.layers, blocks=args.blocks, backends=tuple(args.backends.split(",")))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbroker", description="kvbroker operator CLI")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in (("status", _status, "the daemon's identity and counts"),
                           ("caches", _caches, "the daemon's caches"), ("links", _links, "the daemon's links")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--target", default=DEFAULT_TARGET, help="daemon address: unix:///path or host:port")
        p.add_argument("--timeout", type=float, default=5.0)
        p.set_defaults(fn=fn)
    p = sub.add_parser("demo", help="two local daemons, a real verified pull, and its throughput")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--backends", default="shm,tcp", help="backend order for both daemons, e.g. tcp")
    p.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except LlmError as e:
        print(f"error: {e.status.name}: {e.message}", file=sys.stderr)
        if e.status in _HINTS:
            print(f"hint: {_HINTS[e.status]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
