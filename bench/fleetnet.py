"""The fleet benchmark's network: test hosts as network namespaces on one bridge, with shaped links.

One hub namespace holds a bridge; each node is a namespace with one veth pair (node end in the node, hub end on
the bridge) and an address in 10.77.0.0/16. Every name carries the run's tag, so concurrent runs never meet, and
`Net.down` removes every namespace of the run (the bridge and the veths go with them). Nothing is added to the
host's own namespace: traffic stays inside the run's namespaces.

Shaping is on each node's egress: `tc netem delay D rate R` where the kernel has netem; where it has not
(CONFIG_NET_SCH_NETEM unset, as on this machine's Firecracker kernel) the rate is shaped with `tbf` and the delay
is not applied, which `Net.shaping` says (and the benchmark's report repeats).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

PREFIX = "kvfl"
"""Namespaces of fleet runs are named kvfl<tag>...; a run removes only those with its own tag."""


class NetError(RuntimeError):
    pass


def run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise NetError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's `ip` and `tc`"
    name = f"{PREFIX}probe{uuid.uuid4().hex[:6]}"
    out = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass(frozen=True)
class Node:
    ns: str
    ip: str


class Net:
    def __init__(self, delay: str, rate: str, *, require_netem: bool = False) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.hub = f"{PREFIX}{self.tag}h"
        self.delay, self.rate = delay, rate
        self.require_netem = require_netem
        self.shaping = ""
        """What the node links really got, e.g. "netem delay 0.5ms rate 10gbit" or "tbf rate 10gbit (...)"."""
        self._count = 0

    def up(self) -> None:
        run("ip", "netns", "add", self.hub)
        run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.hub, "link", "set", "br0", "up")

    def add_node(self) -> Node:
        """A fresh namespace with a fresh address: a new pod (its own IP) on the fleet's network."""
        n = self._count
        self._count += 1
        if n >= 250 * 250:
            raise NetError("out of addresses")
        node = Node(ns=f"{PREFIX}{self.tag}n{n}", ip=f"10.77.{n // 250}.{n % 250 + 1}")
        inner, outer = f"kf{self.tag}n{n}", f"kf{self.tag}h{n}"
        run("ip", "netns", "add", node.ns)
        try:
            run("ip", "-n", node.ns, "link", "set", "lo", "up")
            run("ip", "link", "add", inner, "netns", node.ns, "type", "veth", "peer", "name", outer, "netns", self.hub)
            run("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
            run("ip", "-n", self.hub, "link", "set", outer, "up")
            run("ip", "-n", node.ns, "addr", "add", f"{node.ip}/16", "dev", inner)
            run("ip", "-n", node.ns, "link", "set", inner, "up")
            self._shape(node.ns, inner)
        except BaseException:
            self.remove_node(node)
            raise
        return node

    def _shape(self, ns: str, dev: str) -> None:
        netem = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", self.delay, "rate", self.rate]
        out = subprocess.run(netem, capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            self.shaping = f"netem delay {self.delay} rate {self.rate} (each node's egress)"
            return
        if self.require_netem or "unknown" not in out.stderr.lower():
            raise NetError(f"{' '.join(netem)}: {out.stderr.strip()}")
        # No netem in this kernel: the rate alone, with a bucket deep enough for a 64 KiB GSO packet at 10 Gbit/s.
        run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "1mb",
            "latency", "50ms")
        self.shaping = (f"tbf rate {self.rate} (each node's egress); NO added delay: this kernel has no netem "
                        f"(asked for delay {self.delay})")

    def remove_node(self, node: Node) -> None:
        subprocess.run(["ip", "netns", "del", node.ns], capture_output=True, timeout=30)

    def down(self) -> list[str]:
        """Removes every namespace of this run; returns those that would not go (for the report)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        mine = [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}{self.tag}")]
        for ns in sorted(mine, key=lambda n: n == self.hub):  # nodes first, the hub (and its bridge) last
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}{self.tag}")]

    @staticmethod
    def wrapper(node: Node) -> list[str]:
        return ["ip", "netns", "exec", node.ns]
