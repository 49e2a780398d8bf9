"""Mid-refit failures on real parts: SeaweedFS behind a fault-injecting proxy, real senders
(TensorSender + the commit protocol), followers as receivers, real processes where a
process dies. Each test proves: every receiver ends bit-exact with the dense weights of the
last committed version (the oracle: the sender's BF16 tensors), nothing unverified is ever
applied, and no wait is unbounded. Each adds a row to the fault table (docs/FAULTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender

ROOT = Path(__file__).resolve().parents[2]


def _states(steps: int, n: int = 6, shape=(256, 515), rate: float = 0.03, seed: int = 0):
    """BF16 weights and `steps` updates changing ~rate of the elements by a few ulps."""
    g = torch.Generator().manual_seed(seed)
    cur = {f"layer.{i}.w": (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}
    out = [cur]
    for _ in range(steps):
        nxt = {}
        for k, t in out[-1].items():
            b = bits(t).clone()
            m = torch.rand(b.shape, generator=g) < rate
            step = torch.randint(1, 4, b.shape, generator=g, dtype=torch.int16)
            b[m] += step[m]
            nxt[k] = b.view(torch.bfloat16)
        out.append(nxt)
    return out


def _same(a, b) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in b)


def _clone(t):
    return {k: v.clone() for k, v in t.items()}


class Fleet:
    """Receivers following a store in threads; errors are collected, not lost."""

    def __init__(self, store, start, n=2, until=None, decision_timeout=30.0):
        self.tensors = [_clone(start) for _ in range(n)]
        stores = store if isinstance(store, list) else [store] * n
        self.followers = [Follower(st, t, receiver_id=f"rx-{i}", poll_s=0.005, decision_timeout=decision_timeout)
                          for i, (st, t) in enumerate(zip(stores, self.tensors, strict=True))]
        self.errors: list[BaseException] = []
        self.until = until

    def run(self, until: int, timeout: float = 60.0) -> None:
        def go(f):
            try:
                f.follow(until=until, timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

        self.threads = [threading.Thread(target=go, args=(f,)) for f in self.followers]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 60.0) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a receiver is stuck"


def _send(store, v, base, old, new, world=2, part_bytes=16 << 10):
    senders = []
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.stream(store, v, base, part_bytes=part_bytes)
        senders.append(s)
    return senders


def _version_bytes(store, v) -> int:
    return sum(len(store.get(k)) for k in store.list(commit.vdir(v)) if k.endswith(".dcr"))


# ------------------------------------------------------------------ the store misbehaves
@pytest.mark.parametrize("fault", ["5xx", "throttle", "timeout", "reset", "truncated-body"])
def test_store_faults_are_retried(stores, proxy, table, fault):
    """Transient store failures on uploads and downloads: retried with backoff, nothing lost."""
    via, direct = stores
    states = _states(1)
    part = r"/rank-\d+/part-\d+\.dcr"
    if fault == "5xx":
        rules = [proxy.add(method="PUT", path=part, times=3), proxy.add(method="GET", path=part, times=3)]
    elif fault == "throttle":
        rules = [proxy.add(method="PUT", path=part, code="SlowDown", times=3),
                 proxy.add(method="GET", path=part, code="SlowDown", times=3)]
    elif fault == "timeout":
        rules = [proxy.add(method="GET", path=part, action="delay", delay_s=3.0, times=2)]
    elif fault == "reset":
        rules = [proxy.add(method="PUT", path=part, action="reset", times=2),
                 proxy.add(method="GET", path=part, action="reset", times=2)]
    else:
        rules = [proxy.add(method="GET", path=part, action="truncate", times=2)]
    fleet = Fleet(via, states[0])
    fleet.run(until=1)
    t0 = time.perf_counter()
    senders = _send(via, 1, 0, states[0], states[1])
    d = commit.run_commit(via, commit.seal_version(via, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    fleet.join()
    assert not fleet.errors, fleet.errors
    assert d["decision"] == "commit" and all(_same(t, states[1]) for t in fleet.tensors)
    for s in senders:
        s.settle()
    assert all(r.hits == r.times for r in rules), [(r.method, r.hits) for r in rules]
    resent = sum(r.hit_bytes for r in rules)
    table(f"store: {fault} on part uploads/downloads ({sum(r.hits for r in rules)} requests)",
          "retried with backoff; version committed; receivers bit-exact", time.perf_counter() - t0, resent)


def test_store_down_aborts_and_restores_then_recovers(stores, proxy, table):
    """The store refuses every part upload: the sender's upload fails with a clear error after
    bounded retries, the version is aborted and the baseline restored bit-exact; once the store
    is back, the next version carries every change and receivers end bit-exact."""
    via, direct = stores
    states = _states(2)
    fleet = Fleet(via, states[0])
    fleet.run(until=2)
    proxy.add(method="PUT", path=r"/rank-00000/part-", times=-1)
    s0 = TensorSender(states[0], 0, 2)
    s1 = TensorSender(states[0], 1, 2)
    for s in (s0, s1):
        for n in s.tensors:
            s.tensors[n] = states[1][n]
    t0 = time.perf_counter()
    s1.stream(via, 1, 0, part_bytes=16 << 10)
    with pytest.raises(StoreError, match="503|ServiceUnavailable"):
        s0.stream(via, 1, 0, part_bytes=16 << 10)
    for s in (s0, s1):
        s.roll_back()  # the trainer's undo: baselines back to version 0
    for s in (s0, s1):
        assert all(torch.equal(bits(s.baselines[n].view(states[0][n].shape)), bits(states[0][n])) for n in s.tensors)
    commit.decide(direct, 1, 0, "abort", [], [], "rank 0 upload failed")
    proxy.clear()
    senders = _send(via, 2, 0, states[0], states[2])
    d = commit.run_commit(via, commit.seal_version(via, 2, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    fleet.join()
    assert not fleet.errors, fleet.errors
    assert d["decision"] == "commit" and all(_same(t, states[2]) for t in fleet.tensors)
    for f in fleet.followers:
        assert f.version == 2
    del senders
    table("store: down for every part upload of one rank",
          "clear StoreError after bounded retries; version aborted, baselines restored bit-exact; next version "
          "carries all changes; receivers bit-exact", time.perf_counter() - t0, _version_bytes(direct, 2))


# ------------------------------------------------------------------ chunks damaged in the store
def _tamper(direct, v, how):
    """Damage at rest (bit rot, a broken copy): committed objects are create-only through the
    store's API, so each damaged object is deleted and written anew."""
    parts = sorted(k for k in direct.list(commit.vdir(v)) if k.endswith(".dcr"))
    a, b = parts[0], parts[1]
    blob = direct.get(a)

    def rewrite(key, data):
        direct.delete([key])
        direct.put(key, data)

    if how == "corrupt":
        x = bytearray(blob)
        x[len(x) // 2] ^= 0x10
        rewrite(a, bytes(x))
    elif how == "truncated":
        rewrite(a, blob[: len(blob) - 100])
    elif how == "missing":
        direct.delete([a])
    elif how == "duplicated":  # a chunk repeated inside a part
        first = codec.split_chunks(blob)[0]
        rewrite(a, blob + bytes(first))
    elif how == "reordered":  # two parts' contents swapped
        rewrite(a, direct.get(b))
        rewrite(b, blob)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing", "duplicated", "reordered"])
def test_damaged_chunks_refused_aborted_and_resent(stores, table, how):
    """A damaged version is refused by every receiver (ack with the reason), aborted by the
    committer, undone at the sender; receivers' weights are untouched; the next version
    resends the changes and everyone ends bit-exact."""
    via, direct = stores
    states = _states(2)
    fleet = Fleet(direct, states[0])
    senders = _send(direct, 1, 0, states[0], states[1])
    _tamper(direct, 1, how)
    rec = commit.seal_version(direct, 1, 0, 2, timeout=30)
    fleet.run(until=2)
    t0 = time.perf_counter()
    d = commit.run_commit(direct, rec, commit.CommitPolicy("abort", timeout=30))
    assert d["decision"] == "abort", d
    acks = commit.read_acks(direct, 1)  # the first refusal aborts: a receiver that sees the abort
    assert acks and not any(a["ok"] for a in acks.values())  # first skips the version without an ack
    reason = next(iter(acks.values()))["error"]
    assert {"corrupt": "checksum", "truncated": "truncated", "missing": "missing", "duplicated": "manifest",
            "reordered": "manifest"}[how] in reason, reason
    assert all(_same(t, states[0]) for t in fleet.tensors)  # nothing of the damaged version applied
    for s in senders:
        s.roll_back()
    _send(direct, 2, 0, states[0], states[2])
    d2 = commit.run_commit(direct, commit.seal_version(direct, 2, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    fleet.join()
    assert not fleet.errors, fleet.errors
    assert d2["decision"] == "commit" and all(_same(t, states[2]) for t in fleet.tensors)
    table(f"chunk {how} in the store", f"refused by every receiver (ack: \"{reason.split('.dcr: ', 1)[-1][:64]}\"); "
          "aborted, sender undone, weights untouched; next version applied bit-exact",
          time.perf_counter() - t0, _version_bytes(direct, 2))


def test_delayed_part_waits_bounded(stores, proxy, table):
    """A part that arrives late (a slow path to the store) delays the version, nothing else."""
    via, direct = stores
    states = _states(1)
    rule = proxy.add(method="GET", path=r"/rank-00001/part-000000\.dcr", action="delay", delay_s=1.5, times=2)
    fleet = Fleet(via, states[0])
    fleet.run(until=1)
    t0 = time.perf_counter()
    _send(direct, 1, 0, states[0], states[1])
    d = commit.run_commit(direct, commit.seal_version(direct, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 30))
    fleet.join()
    took = time.perf_counter() - t0
    assert not fleet.errors and d["decision"] == "commit" and rule.hits == 2
    assert all(_same(t, states[1]) for t in fleet.tensors) and took >= 1.5
    table("chunk delayed 1.5 s (acks late)", "waited (bounded by the decision timeout); committed; bit-exact", took,
          rule.hit_bytes)


# ------------------------------------------------------------------ receivers that are wrong or slow
def test_wrong_baseline_or_wrong_model_refused(stores, table):
    via, direct = stores
    states = _states(2)
    _send(direct, 1, 0, states[0], states[1])
    commit.run_commit(direct, commit.seal_version(direct, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 30))
    skipped = _clone(states[2])  # holds something else but claims version 1
    with pytest.raises(codec.ChunkError, match="does not hold version 1"):
        Follower(direct, skipped, version=1)
    assert _same(skipped, states[2])
    wrong = {k.replace("layer", "block"): v for k, v in _clone(states[0]).items()}
    with pytest.raises(codec.ChunkError, match="no tensor"):
        Follower(direct, wrong).apply_version(1)
    assert all(torch.equal(bits(wrong[k.replace("layer", "block")]), bits(states[0][k])) for k in states[0])
    table("receiver at the wrong baseline / with the wrong model",
          "refused at start-up (digests) / before any write (tensor names); weights untouched", None, None)


@pytest.mark.parametrize("policy", ["wait", "abort", "quorum"])
def test_acks_that_never_come(stores, table, policy):
    """One registered receiver never acks: wait -> a clear CommitTimeout (the trainer sees it,
    nothing committed); abort -> aborted and undone; quorum -> committed, the silent one marked
    lagging, and it catches up by chained deltas later, bit-exact."""
    via, direct = stores
    states = _states(2)
    commit.register(direct, "silent", 0)
    fleet = Fleet(direct, states[0], n=1, decision_timeout=4.0)
    fleet.run(until=1, timeout=4.0)  # rx-0 acks; under wait/abort it then sees no commit and times out
    senders = _send(direct, 1, 0, states[0], states[1])
    rec = commit.seal_version(direct, 1, 0, 2, timeout=30)
    pol = commit.CommitPolicy(policy, timeout=1.0, quorum=0.5)
    t0 = time.perf_counter()
    if policy == "wait":
        with pytest.raises(commit.CommitTimeout, match="no ack from \\['silent'\\]"):
            commit.run_commit(direct, rec, pol)
        outcome = "CommitTimeout after the ack timeout, naming the receiver; nothing committed"
        assert commit.read_decision(direct, 1) is None
    else:
        d = commit.run_commit(direct, rec, pol)
        if policy == "abort":
            assert d["decision"] == "abort" and d["lagging"] == ["silent"]
            for s in senders:
                s.roll_back()
            outcome = "aborted after the ack timeout; sender undone"
        else:
            assert d["decision"] == "commit" and d["lagging"] == ["silent"] and d["acked"] == ["rx-0"]
            late = Follower(direct, _clone(states[0]), receiver_id="silent")
            late.follow(until=1, timeout=30)
            assert _same(late.tensors, states[1])
            outcome = "committed by quorum; the silent receiver marked lagging, later caught up bit-exact"
    took = time.perf_counter() - t0
    assert took < 5.0  # bounded: the ack timeout, not forever
    fleet.join(30)
    if policy == "quorum":
        assert not fleet.errors and all(_same(t, states[1]) for t in fleet.tensors)
    else:  # the receiver that acked holds version 0, untouched, and says why it stopped
        assert all(_same(t, states[0]) for t in fleet.tensors)
        assert all(isinstance(e, TimeoutError) for e in fleet.errors), fleet.errors
    table(f"acks never come (policy {policy})", outcome, took, 0)


# ------------------------------------------------------------------ processes that die
@pytest.mark.slow
def test_receiver_killed_mid_apply_resumes_without_reload(seaweed, proxy, tmp_path, table):
    """`nemo-dcr receive --model-dir` SIGKILLed between two tensor writes of an apply; restarted,
    it completes the version from its redo log and goes on: bit-exact with the dense weights,
    and no keyframe (no full model) is downloaded after the crash."""
    from safetensors.torch import load_file, save_file

    prefix = "recv-kill"
    store = seaweed.store(prefix)
    states = _states(2)
    model = tmp_path / "model"
    model.mkdir()
    save_file(states[0], str(model / "model.safetensors"))
    url = f"s3://{seaweed.bucket}/{prefix}?endpoint={proxy.endpoint}"
    env = {**os.environ, **seaweed.env(), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "nemo_dcr_callback.cli", "receive", "--store", url, "--model-dir", str(model),
           "--id", "rx-dir", "--follow", "--until", "2", "--timeout", "60"]
    p = subprocess.Popen(cmd, env={**env, "NEMO_DCR_RECEIVER_FAULT": "kill-after:3"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    _send(store, 1, 0, states[0], states[1])
    d = commit.run_commit(store, commit.seal_version(store, 1, 0, 2, timeout=30),
                          commit.CommitPolicy("quorum", timeout=30, quorum=1.0))
    assert d["decision"] == "commit"
    assert p.wait(60) == -9  # killed mid-apply
    t0 = time.perf_counter()
    seen = len(proxy.log)
    p2 = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    _send(store, 2, 1, states[1], states[2])
    d2 = commit.run_commit(store, commit.seal_version(store, 2, 1, 2, timeout=30), commit.CommitPolicy("wait", 60))
    out = p2.communicate(timeout=120)[0]
    assert p2.returncode == 0 and d2["decision"] == "commit", out
    assert "holds version 1" in out, out  # the redo log completed version 1 on open
    assert _same(load_file(str(model / "model.safetensors")), states[2])
    after = proxy.log[seen:]
    assert not any("keyframe" in path for _, path in after)  # no full model fetched
    fetched = sum(len(store.get(k)) for k in store.list(commit.vdir(1)) if k.endswith(".dcr"))
    assert not any(commit.vdir(1) in path and path.endswith(".dcr") for m, path in after if m == "GET"), fetched
    table("receiver killed mid-apply (checkpoint dir) and restarted",
          "redo log replayed on open (version 1 completed), then version 2 applied; bit-exact; no reload, "
          "nothing of version 1 fetched again", time.perf_counter() - t0, 0)


@pytest.mark.slow
def test_relay_killed_mid_version(seaweed, tmp_path, table):
    """A region relay SIGKILLs itself mid-version: its receivers re-attach to the root relay and
    finish; every part is downloaded once per receiver (nothing verified is fetched again)."""
    from nemo_dcr_callback.transport.store import open_store

    prefix = "relay-kill"
    origin = seaweed.store(prefix)
    s3url = seaweed.url(f"{seaweed.bucket}/{prefix}")
    env = {**os.environ, **seaweed.env(), "NEMO_DCR_RELAY_TOKEN": "faults", "PYTHONUNBUFFERED": "1"}
    env.pop("NEMO_DCR_RELAY_FAULT", None)
    procs = []

    def relay(parent, name, fault=None):
        e = {**env, **({"NEMO_DCR_RELAY_FAULT": fault} if fault else {})}
        p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", parent,
                              "--name", name], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        line = p.stdout.readline()
        assert "listening on" in line, line
        return p, line.split("listening on ")[1].split()[0]

    try:
        os.environ["NEMO_DCR_RELAY_TOKEN"] = "faults"
        _, root = relay(s3url, "root")
        region_p, region = relay(f"{root},{s3url}", "region", fault="die:3")
        states = _states(1, n=8)
        chains = [open_store(f"{region},{root},{s3url}") for _ in range(2)]
        for c in chains:
            c.quiet = True
        got: list[dict] = [{} for _ in chains]
        for c, g in zip(chains, got, strict=True):
            inner = c.get

            def counted(key, inner=inner, g=g):
                data = inner(key)
                g[key] = g.get(key, 0) + 1
                return data
            c.get = counted
        fleet = Fleet(chains, states[0])
        fleet.run(until=1)
        _send(origin, 1, 0, states[0], states[1], part_bytes=1)
        d = commit.run_commit(origin, commit.seal_version(origin, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
        fleet.join()
        recover = time.monotonic() - min(c.failed_at for c in chains)
        assert region_p.wait(10) == -9 and d["decision"] == "commit"
        assert not fleet.errors and all(_same(t, states[1]) for t in fleet.tensors)
        parts = {k for k in origin.list("versions") if k.endswith(".dcr")}
        for c, g in zip(chains, got, strict=True):
            assert c.failovers == 1
            assert {k for k in g if k.endswith(".dcr")} == parts and {g[k] for k in parts} == {1}
    finally:
        os.environ.pop("NEMO_DCR_RELAY_TOKEN", None)
        for p in procs:
            p.kill()
            p.wait()
    table("relay killed mid-version (SIGKILL after serving 3 parts)",
          "receivers re-attached to the root relay and finished bit-exact; each part downloaded once per receiver",
          recover, 0)


@pytest.mark.slow
def test_sender_rank_killed_mid_upload_then_restarted_from_checkpoint(seaweed, tmp_path, table):
    """torchrun (TP 2): rank 1 is SIGKILLed while uploading version 3, after 1 and 2 committed;
    the job restarts from its step-1 training checkpoint, rebases on version 2 (rebuilt from the
    store), aborts the unfinished 3 and publishes 4 and 5. The receiver, which never stopped,
    applies 1, 2, 4, 5 and ends bit-exact with the dense export of the restarted job's weights,
    without reloading anything."""
    from safetensors.torch import load

    from nemo_dcr_callback.launcher import torchrun_cmd

    prefix = "sender-restart"
    url = seaweed.url(f"{seaweed.bucket}/{prefix}")
    store = seaweed.store(prefix)
    env = {**os.environ, **seaweed.env(), "PYTHONUNBUFFERED": "1"}
    worker = str(Path(__file__).resolve().parent / "restart_worker.py")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fetched: list[str] = []
    rx_store = seaweed.store(prefix)
    inner = rx_store.get
    rx_store.get = lambda k: (fetched.append(k), inner(k))[1]
    applied: list[int] = []
    box: dict = {}

    def receiver():  # a rollout worker: starts from the keyframe, then follows, never restarted
        kf = f"{commit.keyframe_dir(0)}/model.safetensors"
        while not rx_store.exists(kf):
            time.sleep(0.05)
        box["tensors"] = load(rx_store.get(kf))
        box["f"] = Follower(rx_store, box["tensors"], receiver_id="rx", poll_s=0.005)
        box["f"].follow(until=5, timeout=300, on_apply=lambda a: applied.append(a.version))

    th = threading.Thread(target=receiver)
    th.start()
    p1 = subprocess.run(torchrun_cmd(2, [worker, "first", str(ckpt), url]), capture_output=True, text=True,
                        timeout=600, env={**env, "NEMO_DCR_SENDER_FAULT": "kill:1:3"}, cwd=tmp_path)
    assert p1.returncode != 0, p1.stdout[-2000:]
    assert [(commit.read_decision(store, v) or {}).get("decision") for v in (1, 2)] == ["commit", "commit"], \
        (p1.stdout + p1.stderr)[-4000:]
    assert commit.read_decision(store, 3) is None and commit.read_record(store, 3) is None  # left unfinished
    assert applied == [1, 2]
    seen = len(fetched)
    t0 = time.perf_counter()
    p2 = subprocess.run(torchrun_cmd(2, [worker, "second", str(ckpt), url]), capture_output=True, text=True,
                        timeout=600, env=env, cwd=tmp_path)
    th.join(120)
    out = p2.stdout + p2.stderr
    assert p2.returncode == 0, out[-4000:]
    assert "resumed from version 2; next version 4" in out, out[-3000:]
    assert commit.read_decision(store, 3)["decision"] == "abort"
    assert applied == [1, 2, 4, 5] and box["f"].version == 5
    final = load(store.get("test/final.safetensors"))
    assert _same(box["tensors"], final)  # bit-exact with the dense export of the restarted job
    assert not any("keyframe" in k for k in fetched[seen:])  # no reload
    resent = sum(commit.read_record(store, v)["bytes"] for v in (4,))
    table("sender rank SIGKILLed mid-upload; job restarted from its training checkpoint",
          "unfinished version aborted; senders rebased on the last committed version (rebuilt from the store); "
          "receiver applied 1, 2, 4, 5 bit-exact, no reload", time.perf_counter() - t0, resent)


def _serve_worker(tensors, url, env, journal, until, ready):
    """A receiver process attached to weights that live in shared memory (the serving
    process's): follows the store, applying through the redo journal."""
    os.environ.update(env)
    from nemo_dcr_callback.receiver import Follower as F
    from nemo_dcr_callback.transport.store import open_store

    f = F(open_store(url), tensors, receiver_id="srv", poll_s=0.005, journal=journal)
    ready.put(f.version)
    f.follow(until=until, timeout=120)


@pytest.mark.slow
def test_receiver_killed_mid_apply_in_a_serving_process_resyncs_from_its_journal(seaweed, tmp_path, table):
    """The weights live on in shared memory (the serving process stayed up) while the receiver
    applying to them is SIGKILLed between two tensor writes: they are torn (neither version).
    A new receiver on the same weights replays the redo journal (overwrites), holds version 1
    and goes on to 2: bit-exact, nothing reloaded, no keyframe in the store at all."""
    import torch.multiprocessing as tmp_mp

    prefix = "serve-kill"
    store = seaweed.store(prefix)
    url = seaweed.url(f"{seaweed.bucket}/{prefix}")
    states = _states(2, n=8)
    shared = {k: v.clone().share_memory_() for k, v in states[0].items()}
    ctx = tmp_mp.get_context("spawn")
    journal = str(tmp_path / "journal")
    env = {**seaweed.env(), "NEMO_DCR_RECEIVER_FAULT": "kill-after:3"}
    ready = ctx.Queue()
    p = ctx.Process(target=_serve_worker, args=(shared, url, env, journal, 1, ready))
    p.start()
    assert ready.get(timeout=120) == 0
    _send(store, 1, 0, states[0], states[1])
    commit.run_commit(store, commit.seal_version(store, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    p.join(60)
    assert p.exitcode == -9
    assert not _same(shared, states[0]) and not _same(shared, states[1])  # torn
    t0 = time.perf_counter()
    env.pop("NEMO_DCR_RECEIVER_FAULT")
    p2 = ctx.Process(target=_serve_worker, args=(shared, url, env, journal, 2, ready))
    p2.start()
    assert ready.get(timeout=120) == 1  # the journal completed version 1
    assert _same(shared, states[1])
    _send(store, 2, 1, states[1], states[2])
    commit.run_commit(store, commit.seal_version(store, 2, 1, 2, timeout=30), commit.CommitPolicy("wait", 60))
    p2.join(60)
    assert p2.exitcode == 0 and _same(shared, states[2])
    assert not store.list("keyframe")
    table("receiver killed mid-apply inside a serving process that stayed up (weights in shared memory)",
          "weights torn; the restarted receiver replayed its redo journal (version 1 complete), then applied 2; "
          "bit-exact; no reload", time.perf_counter() - t0, 0)
