"""The soak's processes and the network between them: every long-lived part is a real process
in its own session, signalled as a process tree (torchrun's ranks run in sessions of their
own), kept running by a supervisor the way Slurm or Kubernetes would restart it, and sampled for RSS.

Nothing here stands in for a part: SeaweedFS, `nemo-dcr relay`, `nemo-dcr receive` and the
torchrun trainer are the product's own commands. Two pieces are the soak's: the TCP link that
can be cut (`Link`) and the fault proxy in front of S3 (tests/faults/faultproxy.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from nemo_dcr_callback.launcher import descendants, proc_stat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pids) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            continue
    return total


@dataclass
class Exit:
    """A supervised process's exit and what explains it: "fault" (a kill or stop fault hit this
    instance of it, however long its tear-down took), "soak" (the soak itself stopped it), or
    None: nothing aimed at it did, which the soak counts as a violation."""

    t: float
    name: str
    rc: int
    cause: str | None
    tail: str

    @property
    def killed_by_fault(self) -> bool:
        return self.cause == "fault"


@dataclass
class Proc:
    """A supervised process group: argv and env come from `make` (called at every start, so a
    restart can pick up new ports or paths)."""

    name: str
    make: object  # () -> (argv, env)
    log: Path
    restart_s: float = 1.0
    popen: subprocess.Popen | None = None
    wanted: bool = True
    starts: int = 0
    # when a kill or stop fault last hit it: an exit of the instance it hit is that fault's
    # consequence (a rank killed, torchrun tearing the group down, a stopped receiver's timeout)
    fault_at: float = -1.0
    down_until: float = 0.0  # a kill fault's hold: not restarted before this
    stopped: bool = False
    exited_at: float = 0.0
    known: dict = field(default_factory=dict)  # pid -> start time, of this instance's processes
    spawn: object = None  # () -> Popen, for a part that starts itself (SeaweedFS: its health check)
    instances: list[dict] = field(default_factory=list)  # per start: {"t0", "rss": [(t, bytes)]}

    def start(self) -> None:
        if self.spawn is not None:
            self.known = {}
            self.popen = self.spawn()
            self.starts += 1
            self.stopped = False
            self.instances.append({"t0": time.monotonic(), "pid": self.popen.pid, "rss": []})
            return
        self.known = {}
        argv, env = self.make()
        with open(self.log, "ab") as f:
            f.write(f"\n===== start {self.starts} at {time.time():.3f}: {' '.join(argv)}\n".encode())
            self.popen = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self.starts += 1
        self.stopped = False
        self.instances.append({"t0": time.monotonic(), "pid": self.popen.pid, "rss": []})

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def track(self) -> list[int]:
        """The processes of this instance now (the launcher and its tree), remembered with their
        start times: a rank orphaned when its launcher died is still found and signalled."""
        known = dict(self.known)  # (threads call this: the watch's RSS sampler, the supervisor, faults)
        if self.popen is not None:
            for pid in [self.popen.pid, *descendants(self.popen.pid)]:
                if (st := proc_stat(pid)) is not None:
                    known[pid] = st[1]
        self.known = {pid: t for pid, t in known.items() if (st := proc_stat(pid)) is not None and st[1] == t}
        return list(self.known)

    def signal(self, sig: int) -> None:
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        for pid in self.track():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def hit(self) -> None:
        """A fault aimed at this process fires now."""
        self.fault_at = time.monotonic()

    def explains(self) -> str | None:
        """What explains an exit of the current instance (Exit.cause)."""
        if not self.wanted:
            return "soak"
        t0 = self.instances[-1]["t0"] if self.instances else 0.0
        return "fault" if self.fault_at >= t0 else None

    def kill(self, hold_s: float = 0.0) -> None:
        self.hit()
        self.down_until = time.monotonic() + hold_s
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)

    def tail(self, n: int = 1500) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class Supervisor:
    """Restarts every wanted process that is not running (after its hold and a backoff), and
    records each exit: a fault's kill, or not (an exit nobody caused is reported)."""

    def __init__(self, procs: list[Proc], on_exit=None):
        self.procs = {p.name: p for p in procs}
        self.exits: list[Exit] = []
        self.on_exit = on_exit  # (Exit) -> None: the watch counts the unexplained ones
        self._stop = threading.Event()
        self.lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="supervisor")

    def start(self) -> None:
        for p in self.procs.values():
            p.start()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self.lock:
                for p in self.procs.values():
                    if p.popen is not None and p.popen.poll() is not None:
                        rc = p.popen.returncode
                        self.exits.append(Exit(now, p.name, rc, p.explains(), p.tail()))
                        if self.on_exit is not None:
                            self.on_exit(self.exits[-1])
                        p.signal(signal.SIGKILL)  # what is left of its group (torchrun's other rank)
                        p.popen, p.exited_at = None, now
                    if p.popen is None and p.wanted and now >= p.down_until and now - p.exited_at >= p.restart_s:
                        try:
                            p.start()
                        except Exception as exc:  # noqa: BLE001 - tried again at the next tick
                            p.popen, p.exited_at = None, now
                            # the harness's own start (an operator's restart script reading the
                            # store under a fault): retried at the next tick, not a product exit
                            self.exits.append(Exit(now, p.name, -1, "start", f"start failed: {exc}"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for p in self.procs.values():
            p.wanted = False
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            while p.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            p.signal(signal.SIGKILL)
            if p.popen is not None:
                p.popen.wait()


class Link:
    """A TCP link (client -> 127.0.0.1:port -> upstream) that can be cut: `refuse` closes every
    connection and refuses new ones; `blackhole` keeps them open and forwards nothing (a
    partition: only the peers' timeouts notice)."""

    def __init__(self, upstream_port: int):
        self.up = upstream_port
        self.mode: str | None = None
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="link").start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "refuse":
                c.close()
                continue
            try:
                u = socket.create_connection(("127.0.0.1", self.up), timeout=5)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                while self.mode == "blackhole":  # held, not forwarded
                    time.sleep(0.05)
                if self.mode == "refuse":
                    break
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.close()
            except OSError:
                pass
        with self._lock:
            self._conns = [s for s in self._conns if s not in (a, b)]

    def cut(self, mode: str) -> None:
        self.mode = mode
        if mode == "refuse":
            with self._lock:
                for s in self._conns:
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def heal(self) -> None:
        self.mode = None


class Tmpfs:
    """A small tmpfs (the checkpoint-directory receiver's disk), which a fault fills."""

    def __init__(self, path: Path, size_mb: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)
        self.filler = path / "filler.bin"

    def fill(self) -> None:
        """Every free byte taken (ENOSPC for the next write)."""
        with open(self.filler, "wb", buffering=0) as f:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    f.write(chunk)
            except OSError:
                pass
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def umount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def can_mount_tmpfs() -> bool:
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/nemo-dcr-soak-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], check=False)
    probe.rmdir()
    return ok


# the trainer's stated stop time (trainer.stop_grace_s, recipes/stop.py), and torchrun's exit
STOP_WITHIN_S = 25.0


def training_ranks(p: Proc) -> list[int]:
    """The training ranks of a torchrun instance (not the launcher, not their workers)."""
    ranks = []
    for pid in p.track():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "recipes.train" in cmd and "torch.distributed.run" not in cmd:
            ranks.append(pid)
    return ranks


def kill_one_rank(p: Proc) -> None:
    """SIGKILL one training rank (torchrun then stops the other and exits); the whole tree if
    none is up yet (a restart under way)."""
    ranks = training_ranks(p)
    if ranks:
        os.kill(max(ranks), signal.SIGKILL)
    else:
        p.signal(signal.SIGKILL)


def stop_trainer(p: Proc, within_s: float) -> bool | str:
    """SIGTERM to each rank, as a scheduler's preemption: torchrun exits 0 once they all did.
    True if it did within within_s; else what happened (it is then killed)."""
    for pid in training_ranks(p):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    launcher, t0 = p.popen, time.monotonic()  # (the supervisor may drop p.popen once it exited)
    if launcher is None:
        return True
    while launcher.poll() is None and time.monotonic() - t0 < within_s:
        time.sleep(0.1)
    if launcher.poll() is None:
        p.signal(signal.SIGKILL)
        return f"was still running {within_s:.0f} s later (killed)"
    rc = launcher.returncode
    return True if rc == 0 else f"exited with rc {rc} after {time.monotonic() - t0:.1f} s"
