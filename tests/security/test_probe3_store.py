"""Issue 66 (the third probe): stores and relays, findings 1-6, 12 and 14.

Each test names its finding. Real parts throughout: file:// stores, `nemo-dcr relay`
processes, the `nemo-dcr status` and `gc` CLIs; memory is measured as peak RSS (VmHWM) above
a baseline taken in the same process, in a subprocess capped at baseline + 256 MB
(tests/helpers/capped.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.transport.relay_store import RelayStore
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.capped import bad_results, run_capped
from tests.helpers.cli import EXE as CLI
from tests.helpers.relay_process import request, start_relay

PUB, RECV = "probe3-publisher-token", "probe3-receivers-token"
ENV = {"NEMO_DCR_RELAY_TOKEN": PUB, "NEMO_DCR_RELAY_RECEIVER_TOKEN": RECV}
# what the probe wrote into the origin's receivers/ (the receivers' role may write there)
JUNK = {"garbage.json": b"garbage",
        "deep.json": b"[" * 10_000 + b"]" * 10_000,
        "digits.json": b'{"receiver":"digits","version":' + b"9" * 5000 + b',"time":1.0}'}


def _relay(origin: Path):
    p, url = start_relay(origin, ENV)
    assert p.poll() is None, url
    return p, url


def _stop(p) -> None:
    p.kill()
    p.wait()


def _hwm_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_f1_junk_registrations_read_through_a_relay_are_bad_records(tmp_path):
    """Finding 1: junk registrations came back through a relay as 502/500, which the reader
    took for a failing store: `receivers()` raised, `status --store relay://` exited 2 and a
    publish raised. Now the relay answers 422 with the reason and every reader skips them."""
    origin = FileStore(tmp_path / "origin")
    for name, body in JUNK.items():
        origin.put(f"receivers/{name}", body)
    commit.register(origin, "good", 0)
    p, url = _relay(tmp_path / "origin")
    try:
        for name in JUNK:
            status, body = request(url, "GET", f"receivers/{name}", RECV)
            assert status == 422 and b"bad record" in body, (name, status, body[:200])
        store = RelayStore(url.replace("http://", "relay://"), token=PUB)
        assert list(commit.receivers(store)) == ["good"]
        st = _cli("status", "--store", url.replace("http://", "relay://"), env={"NEMO_DCR_RELAY_TOKEN": PUB})
        assert st.returncode == 0 and "Traceback" not in st.stdout + st.stderr, st.stdout + st.stderr
        for name in JUNK:
            assert f"receivers/{name}" in st.stderr, st.stderr
        # the committer's read of acks by name: a bad one is skipped, not a failing store
        origin.put(keys.version_record(1), b"{}")
        origin.put(commit.ack_key(1, "evil"), b"[" * 10_000)
        assert commit.read_acks(store, 1, expected=["evil"]) == {}
    finally:
        _stop(p)


def test_f1_a_publish_through_a_relay_over_junk_registrations(tmp_path):
    """Finding 1, the trainer's side: NamedPublisher.publish through a relay with junk in the
    origin's receivers/ commits (it raised)."""
    import torch

    from nemo_dcr_callback.config import CommitPolicy
    from nemo_dcr_callback.sender.named import NamedPublisher

    origin = FileStore(tmp_path / "origin")
    for name, body in JUNK.items():
        origin.put(f"receivers/{name}", body)
    p, url = _relay(tmp_path / "origin")
    try:
        w = {"w": torch.zeros(64, dtype=torch.bfloat16)}
        pub = NamedPublisher(RelayStore(url.replace("http://", "relay://"), token=PUB), w.items(),
                             policy=CommitPolicy(mode="quorum", quorum=0.0, timeout=5.0))
        w["w"] += 1
        d = pub.publish(w.items())
        assert d["decision"] == "commit", d
    finally:
        _stop(p)


def test_f2_a_racing_link_swap_never_reads_outside_the_store(tmp_path):
    """Finding 2: FileStore.get checked the real path, then opened the path again; a receiver
    swapping receivers/leak between a file and a link to /proc/self/environ read the relay's
    environment (its publisher token). Now every open refuses a link at every component on
    the descriptor it reads: a swapping thread, reads direct and through a relay."""
    secret = tmp_path / "outside" / "environ"
    secret.parent.mkdir()
    secret.write_bytes(b"NEMO_DCR_RELAY_TOKEN=" + PUB.encode())
    root = tmp_path / "origin"
    store = FileStore(root)
    commit.register(store, "leak", 0)
    p, url = _relay(root)
    stop = threading.Event()
    real = (root / "receivers" / "leak.json").read_bytes()

    def swap() -> None:
        link, tmp = root / "receivers" / "leak.json", root / "receivers" / "swap.tmp"
        folder, aside = root / "receivers", tmp_path / "receivers-real"
        while not stop.is_set():
            for target in (secret, real):
                if isinstance(target, Path):
                    os.symlink(target, tmp)
                else:
                    tmp.write_bytes(target)
                os.replace(tmp, link)
            # and a whole folder on the way swapped for a link to the secret's folder
            os.replace(folder, aside)
            os.symlink(secret.parent, folder)
            os.replace(folder, tmp_path / "gone")
            os.unlink(tmp_path / "gone")
            os.replace(aside, folder)

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    leaked, failed, reads = [], [], 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for key in ("receivers/leak.json", "receivers/environ", "receivers/leak"):
                try:
                    got = store.get(key)
                except KeyError:
                    got = b""
                status, body = request(url, "GET", key, RECV)
                reads += 2
                failed += [(key, status, body[:200])] if status >= 500 else []
                leaked += [x for x in (got, body) if b"NEMO_DCR_RELAY_TOKEN" in x]
    finally:
        stop.set()
        t.join()
        _stop(p)
    assert reads > 100 and not leaked, (reads, len(leaked), leaked[:1])
    assert not failed, failed[:3]


def test_f2_keys_under_receivers_that_are_no_record_are_not_served(tmp_path):
    """Finding 2: keys under receivers/ without .json were served unverified; any key that
    is no object of the protocol is now 404 at a relay."""
    root = tmp_path / "origin"
    FileStore(root).put("receivers/leak", b"anything at all")
    FileStore(root).put("a/x", b"not the protocol's")
    p, url = _relay(root)
    try:
        for key in ("receivers/leak", "a/x", "receivers/%00x.json"):
            status, body = request(url, "GET", key, RECV)
            assert status == 404, (key, status, body[:200])
    finally:
        _stop(p)


SPARSE_SETUP = """
import os, sys
sys.path.insert(0, ROOT)
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.transport.store import FileStore
from nemo_dcr_callback.tools import status as status_tool
store = FileStore(STORE)
"""


def test_f3_a_sparse_3_gib_registration_costs_nothing(tmp_path):
    """Finding 3: `read_json` read the whole object, then compared its size with 16 KiB: a
    sparse 3 GiB receivers/big.json cost status 6.4 GB of RSS, gc 3.3 GB and a publish 3.3
    GB. Now every read states its limit and the store refuses by size, unread: the reader,
    gc and the relay stay within 256 MB of peak RSS above their baselines."""
    root = tmp_path / "origin"
    store = FileStore(root)
    commit.register(store, "good", 0)
    with open(root / "receivers" / "big.json", "wb") as f:
        f.truncate(3 << 30)
    with open(root / "receivers" / "big-ack.json", "wb") as f:
        f.truncate(3 << 30)
    got = run_capped(SPARSE_SETUP.replace("ROOT", repr(str(Path(__file__).parents[2])))
                     .replace("STORE", repr(str(root))), """
case("receivers", lambda: commit.receivers(store))
case("gc", lambda: commit.gc(store, dry_run=True))
case("read_json", lambda: commit.read_json(store, "receivers/big.json"))
""", expected="(commit.RecordError,)")
    assert bad_results(got) == [] and got["hwm_mb"] < 256, got
    assert [r[1] for r in got["results"]] == ["ok", "ok", "error"], got
    assert "3221225472 bytes" in got["results"][2][2]
    p, url = _relay(root)
    try:
        base = _hwm_mb(p.pid)
        for _ in range(3):
            status, body = request(url, "GET", "receivers/big.json", RECV)
            assert status == 422, (status, body[:200])
        st = _cli("status", "--store", url.replace("http://", "relay://"), env={"NEMO_DCR_RELAY_TOKEN": PUB})
        assert st.returncode == 0, st.stdout + st.stderr
        assert _hwm_mb(p.pid) - base < 256, (base, _hwm_mb(p.pid))
    finally:
        _stop(p)


def test_f4_a_registration_from_the_far_future_is_refused(tmp_path):
    """Finding 4: a registration dated 1e300 counted as live for ever (no quorum 0/1 for
    every version, CommitTimeout under wait). Times beyond the stated clock skew are refused."""
    store = FileStore(tmp_path)
    store.put("receivers/ghost.json", json.dumps({"receiver": "ghost", "version": 0, "time": 1e300}).encode())
    store.put("receivers/soon.json", json.dumps({"receiver": "soon", "version": 0,
                                                 "time": time.time() + 10 * commit.records.CLOCK_SKEW_S}).encode())
    commit.register(store, "good", 0)
    assert list(commit.receivers(store, live_s=600)) == ["good"]
    assert list(commit.receivers(store)) == ["good"]


def test_a_registration_whose_starting_is_not_a_flag_is_a_bad_record(tmp_path):
    """`starting` takes a receiver out of the quorum's count (Registration.starting): only a
    true boolean does; anything else makes the record a bad one, skipped with a warning."""
    store = FileStore(tmp_path)
    store.put("receivers/odd.json", json.dumps({"receiver": "odd", "version": 0, "time": time.time(),
                                                "starting": "no"}).encode())
    commit.register(store, "good", 0, starting=True)
    assert list(commit.receivers(store)) == ["good"] and commit.receivers(store)["good"]["starting"] is True


def test_f5_an_ack_for_a_version_that_does_not_exist(tmp_path):
    """Finding 5: an ack PUT through a relay for version 9999999999 created that version's
    folder in the origin, and a restarting publisher could not publish ("version 10000000000
    is out of range"). The relay refuses it (400); a folder holding only acks, written around
    the relay, is no version to a restarting publisher."""
    import torch

    from nemo_dcr_callback.config import CommitPolicy
    from nemo_dcr_callback.sender.named import NamedPublisher

    root = tmp_path / "origin"
    store = FileStore(root)
    w = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    policy = CommitPolicy(mode="quorum", quorum=0.0, timeout=5.0)
    pub = NamedPublisher(store, w.items(), policy=policy)
    w["w"] += 1
    assert pub.publish(w.items())["decision"] == "commit"
    p, url = _relay(root)
    try:
        ack = json.dumps({"version": 9999999999, "receiver": "rx", "base": 0, "ok": True, "error": None,
                          "time": time.time()}).encode()
        status, body = request(url, "PUT", commit.ack_key(9999999999, "rx"), RECV, ack)
        assert status == 400 and b"does not exist" in body, (status, body[:200])
        good = json.dumps({"version": 1, "receiver": "rx", "base": 0, "ok": True, "error": None,
                           "time": time.time()}).encode()
        assert request(url, "PUT", commit.ack_key(1, "rx"), RECV, good)[0] == 200
    finally:
        _stop(p)
    assert sorted(c.name for c in (root / "versions").iterdir()) == ["0000000001"]
    # written around the relay (a receiver with write access to the origin's acks)
    commit.write_ack(store, 9999999999, "rx", 0)
    pub2 = NamedPublisher(store, w.items(), policy=policy)
    w["w"] += 1
    assert pub2.publish(w.items())["decision"] == "commit"


def test_f6_the_relays_tables_are_bounded(tmp_path):
    """Finding 6: the relay's `missing` and `lists` tables were never pruned: 40k requests of
    the receivers' token grew it from 277 to 439 MB for good. Every table keyed by what peers
    ask is Bounded; made-up paths share one request counter."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig, node

    TABLE_ENTRIES = getattr(node, "TABLE_ENTRIES", 4096)

    origin = FileStore(tmp_path / "origin")

    async def main():
        relay = Relay(origin, RelayConfig(token=PUB, prefetch=False))
        n = TABLE_ENTRIES + 1000
        for i in range(n):
            await relay.fetch(f"versions/0000000001/rank-00000/part-{i % 1_000_000:06d}.dcr")
            await relay.listing("list", f"junk-{i}")
            relay._passed(f"receivers/r{i}.json", b"{}")
            relay._listed(f"receivers/r{i}.json")
        return relay

    relay = asyncio.run(main())
    for table in (relay.missing, relay.lists, relay.passed, relay.put_at):
        assert len(table) <= TABLE_ENTRIES, (type(table), len(table))


def test_f12_a_receiver_name_with_a_lone_surrogate(tmp_path):
    """Finding 12: a registration naming receiver "\\ud800" passed the schema and `nemo-dcr
    status` then exited 2 ("surrogates not allowed"). Names are printable Unicode without
    surrogates: the record is skipped, status runs."""
    store = FileStore(tmp_path)
    store.put("receivers/odd.json", json.dumps({"receiver": "\ud800", "version": 0, "time": time.time()}).encode())
    store.put("receivers/ctl.json", json.dumps({"receiver": "a\x1bb", "version": 0, "time": time.time()}).encode())
    commit.register(store, "good", 0)
    assert list(commit.receivers(store)) == ["good"]
    st = _cli("status", "--store", f"file://{tmp_path}")
    assert st.returncode == 0 and "Traceback" not in st.stdout + st.stderr, st.stdout + st.stderr


def test_f14_deep_or_long_registration_puts_get_400(tmp_path):
    """Finding 14: a 5,000-deep or 5,000-digit registration PUT to a relay answered 500, not
    the documented 400."""
    p, url = _relay(tmp_path / "origin")
    try:
        for body in (b"[" * 5000 + b"]" * 5000,
                     b'{"receiver":"rx","version":' + b"9" * 5000 + b',"time":1.0}'):
            status, answer = request(url, "PUT", "receivers/rx.json", RECV, body)
            assert status == 400, (status, answer[:200])
    finally:
        _stop(p)
