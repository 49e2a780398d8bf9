"""What the network benchmarks (bench refit, bench relay) share: a shaped link to a network
namespace, and child processes that report in JSON lines.

A region is a network namespace joined to the root namespace by a veth pair shaped with tc
tbf on both ends, so the link, not the computation, is the bottleneck, as between regions.
Needs root (ip netns, tc).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path


def _sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True)


class ShapedLink:
    """A network namespace for the receiver, a veth pair to it, tbf on both ends."""

    def __init__(self, mbit: float, subnet: str = "10.77.0", name: str = ""):
        tag = f"{name}{os.getpid() % 100000}"
        self.ns, self.a, self.b = f"dcr-rx-{tag}", f"dcrs{tag}", f"dcrr{tag}"
        self.ip_a, self.ip_b, self.mbit = f"{subnet}.1", f"{subnet}.2", mbit

    def __enter__(self) -> ShapedLink:
        try:
            _sh("ip", "netns", "add", self.ns)
            _sh("ip", "link", "add", self.a, "type", "veth", "peer", "name", self.b)
            _sh("ip", "link", "set", self.b, "netns", self.ns)
            _sh("ip", "addr", "add", f"{self.ip_a}/24", "dev", self.a)
            _sh("ip", "link", "set", self.a, "up")
            _sh("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ip_b}/24", "dev", self.b)
            _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", self.b, "up")
            _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", self.ns, "ip", "route", "add", "default", "via", self.ip_a)
            rate = f"{self.mbit}mbit"
            burst = f"{max(32, int(self.mbit * 1e6 / 8 / 250 / 1024))}kb"  # ~4 ms of traffic
            _sh("tc", "qdisc", "add", "dev", self.a, "root", "tbf", "rate", rate, "burst", burst, "latency", "200ms")
            _sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.b, "root", "tbf", "rate", rate,
                "burst", burst, "latency", "200ms")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise RuntimeError(f"cannot set up the shaped link (needs root, ip and tc): {e.cmd}: "
                               f"{e.stderr.decode().strip()}") from None
        return self

    def tx_rx(self) -> tuple[int, int]:
        """Bytes sent into and received from the namespace over this link so far."""
        st = Path(f"/sys/class/net/{self.a}/statistics")
        return int((st / "tx_bytes").read_text()), int((st / "rx_bytes").read_text())

    def __exit__(self, *exc) -> None:
        _sh("ip", "link", "del", self.a, check=False)
        _sh("ip", "netns", "del", self.ns, check=False)


def in_ns(ns: str | None, cmd: list[str]) -> list[str]:
    """cmd run inside network namespace ns (None: the root namespace)."""
    return ["ip", "netns", "exec", ns, *cmd] if ns else cmd


class JsonProc:
    """A child process printing JSON lines (a benchmark's receiver, a relay announcing its address),
    read by a thread; its stderr goes to a log file that nobody has to drain."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log = open(log, "w+")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for x in self.p.stdout:
            if x.startswith("{"):
                self.lines.put(json.loads(x))
            elif "listening on" in x:
                self.lines.put({"listening": x.split("listening on ")[1].split()[0]})

    def next(self, timeout: float = 900.0) -> dict:
        """The next JSON line (or relay address); RuntimeError with the log's tail after timeout s."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            self.log.seek(0)
            raise RuntimeError(f"{self.p.args[:6]} stopped answering: {self.log.read()[-2000:]}") from None

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
