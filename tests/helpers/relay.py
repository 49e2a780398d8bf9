"""The relay tests' helpers: `nemo-dcr relay` processes, versions published by TensorSender
ranks (the sender path over canonical tensors held whole, without Megatron placement) on a
file:// origin, and followers attached through relays as receivers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.relay_store import RelayStore
from nemo_dcr_callback.transport.store import open_store

from .tensors import perturb, random_tensor

TOKEN = "test-token-7f3a"


def ack_body(v: int, receiver: str, ok: bool = True) -> bytes:
    """An ack as a receiver writes it (the relay refuses anything else at an ack's key)."""
    return json.dumps({"version": v, "receiver": receiver, "base": v - 1, "ok": ok, "error": None,
                       "time": 1.0}).encode()


def version_folder(store, v: int) -> None:
    """Give version v a folder in the origin (its record): a relay takes acks only for
    versions that exist, as a receiver acks only a version it read."""
    store.put(f"versions/{v:010d}/VERSION.json", json.dumps({
        "version": v, "base": v - 1, "world": 1, "ranks": [], "bytes": 0, "params": 0, "changed": 0,
        "digests": {}, "time": 1.0}).encode())


class RelayProc:
    """A `nemo-dcr relay` process; .url once it listens."""

    def __init__(self, parent: str, name: str, fault: str | None = None, token: str | None = TOKEN,
                 extra: tuple[str, ...] = ()):
        env = {**os.environ, "NEMO_DCR_RELAY_TOKEN": token or ""}
        env.pop("NEMO_DCR_RELAY_FAULT", None)
        if fault:
            env["NEMO_DCR_RELAY_FAULT"] = fault
        args = [sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", parent, "--name", name,
                "--poll-ms", "5", *extra] + ([] if token else ["--no-token"])
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"relay {name} did not start: {line}{self.proc.stdout.read()}")
        self.url = line.split("listening on ")[1].split()[0]
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain

    def stats(self) -> dict:
        return RelayStore(self.url, token=TOKEN).stats()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def relay_states(steps, n=4, shape=(512, 1023), rate=0.03, seed=1):
    g = torch.Generator().manual_seed(seed)
    states = [{f"layer.{i}.w": random_tensor(shape, torch.bfloat16, g, specials=False) for i in range(n)}]
    for _ in range(steps):
        states.append({k: perturb(t, rate, g) for k, t in states[-1].items()})
    return states


def write_ranks(store, v, old, new, world=2, part_bytes=4 << 20):
    """Every sender rank's parts and manifest of version v (not sealed)."""
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.write(store, v, v - 1, s.take(), part_bytes=part_bytes)


def seal_and_commit(store, v, world=2, policy=None):
    rec = commit.seal_version(store, v, v - 1, world, timeout=30)
    return commit.run_commit(store, rec, policy or commit.CommitPolicy("wait", timeout=60))


def publish_version(store, v, old, new, world=2, part_bytes=4 << 20, policy=None):
    write_ranks(store, v, old, new, world, part_bytes)
    return seal_and_commit(store, v, world, policy)


def damaged_part(store) -> tuple[str, bytearray]:
    """Publish a version into store; return one part's key and a copy of it with a bit flipped."""
    states = relay_states(1)
    publish_version(store, 1, states[0], states[1], part_bytes=64 << 10)
    key = next(k for k in store.list("versions") if k.endswith(".dcr"))
    blob = bytearray(store.get(key))
    blob[-20] ^= 1
    return key, blob


class Counting:
    """A store wrapper counting successful gets per key (what was actually downloaded)."""

    def __init__(self, store):
        self.store, self.got = store, {}
        self.lock = threading.Lock()

    def get(self, key, limit=None):
        data = self.store.get(key, limit=limit)
        with self.lock:
            self.got[key] = self.got.get(key, 0) + 1
        return data

    def __getattr__(self, name):
        return getattr(self.store, name)


def start_followers(states, urls, until, ids=True):
    recv = [{k: t.clone() for k, t in states[0].items()} for _ in urls]
    stores = [Counting(open_store(u)) for u in urls]
    for s in stores:
        for sub in getattr(s.store, "stores", [s.store]):
            if isinstance(sub, RelayStore):
                sub.token, sub.headers = TOKEN, {"Authorization": f"Bearer {TOKEN}"}
    fs = [Follower(s, r, receiver_id=f"rx-{i}" if ids else None, poll_s=0.005)
          for i, (s, r) in enumerate(zip(stores, recv, strict=True))]
    errs: list[BaseException] = []

    def run(f):
        try:
            f.follow(until=until, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errs.append(exc)

    ths = [threading.Thread(target=run, args=(f,)) for f in fs]
    for t in ths:
        t.start()
    return recv, stores, ths, errs
