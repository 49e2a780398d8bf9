"""Issue 66: fuzz harness for what receivers write (registrations, acks), read from a store
and PUT to a relay as request bodies.

Deterministic mutations of real records (types swapped, fields missing, huge and negative
numbers, NaN and infinities, deep nesting, long digit runs, odd names, bytes cut or flipped)
run in a subprocess capped at its baseline + 256 MB (tests/helpers/capped.py). Every case
ends in a record, a skip or a clear refusal: never a traceback, never more memory, and a
relay never answers 5xx.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.capped import bad_results, run_capped

ROOT = repr(str(Path(__file__).resolve().parents[2]))

MUTATIONS = r'''
import json, math, random, time

def mutants(seed, n):
    rng = random.Random(seed)
    now = time.time()
    reg = {"receiver": "rx", "version": 3, "time": now}
    ack = {"version": 1, "receiver": "rx", "base": 0, "ok": True, "error": None, "time": now}
    odd = [None, True, False, 0, -1, 1 << 63, 2 ** 64, -2 ** 70, 1.5, 1e300, -1e300, float("nan"),
           float("inf"), "", "x", "\ud800", "a/b", "..", "\x00", "é" * 300, [], {}, [[]], {"a": {}},
           list(range(50)), "9" * 5000]
    raw = [b"", b"{", b"[" * 6000, b"]" * 10, b'{"a":' * 3000, b"\xff\xfe", b"null", b"1e999", b"-0",
           b'{"receiver":"rx","version":' + b"9" * 5000 + b',"time":1}', b"\x00" * 64,
           json.dumps(reg).encode() * 3]
    for i in range(n):
        kind = rng.choice(("registration", "ack"))
        rec = dict(reg if kind == "registration" else ack)
        op = rng.randrange(6)
        if op == 0:
            rec[rng.choice(list(rec))] = rng.choice(odd)
        elif op == 1:
            rec.pop(rng.choice(list(rec)))
        elif op == 2:
            rec[rng.choice(["extra", "receiver", "time"])] = {"deep": [rng.choice(odd)] * rng.randrange(1, 9)}
        elif op == 3:
            for k in rng.sample(list(rec), rng.randrange(1, len(rec))):
                rec[k] = rng.choice(odd)
        if op == 4:
            body = rng.choice(raw)
        else:
            try:
                body = json.dumps(rec).encode("utf-8", "surrogatepass")
            except (ValueError, TypeError):
                body = repr(rec).encode("utf-8", "surrogatepass")
            if op == 5:
                b = bytearray(body)
                for _ in range(rng.randrange(1, 4)):
                    if b:
                        b[rng.randrange(len(b))] = rng.randrange(256)
                body = bytes(b[: rng.randrange(len(b) + 1)]) if rng.random() < 0.3 else bytes(b)
        yield i, kind, body
'''


def test_fuzz_receiver_records_from_a_store():
    """Each mutated record planted in a file:// store and read by the one reader of what
    receivers write (and by `receivers()`, the committer's listing)."""
    got = run_capped(f"""
import sys, tempfile
sys.path.insert(0, {ROOT})
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.transport.store import FileStore
store = FileStore(tempfile.mkdtemp())
{MUTATIONS}
""", """
def one(i, kind, body):
    key = keys.receiver_key(f"r{i}") if kind == "registration" else keys.ack_key(1, f"r{i}")
    store.put(key, body)
    out = commit.read_receiver_records(store, kind, [key])
    assert len(out) == 1 and (out[0] is None or isinstance(out[0], dict))
    if out[0] is not None:  # accepted: then it is a record a reader can use
        assert isinstance(out[0]["receiver"], str) and out[0]["receiver"].isprintable()
        assert 0 <= out[0]["version"] <= keys.MAX_VERSION

import io, contextlib
with contextlib.redirect_stderr(io.StringIO()):
    for i, kind, body in mutants(66, 1500):
        case(f"{kind}-{i}", lambda: one(i, kind, body))
    case("receivers", lambda: commit.receivers(store, live_s=600))
""", expected="()")
    assert bad_results(got) == [], bad_results(got)[:3]
    assert got["hwm_mb"] < 256 and len(got["results"]) == 1501, got["hwm_mb"]


def test_fuzz_receiver_records_put_to_a_relay():
    """Each mutated record PUT to a relay (in process, over a file:// origin) with the
    receivers' token: a 2xx or a 4xx with a reason, never 5xx; then read back through the
    relay, a record or a skip."""
    got = run_capped(f"""
import asyncio, http.client, json, sys, tempfile, threading
sys.path.insert(0, {ROOT})
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.transport.relay import Relay, RelayConfig
from nemo_dcr_callback.transport.relay_store import RelayStore
from nemo_dcr_callback.transport.store import FileStore
origin = FileStore(tempfile.mkdtemp())
origin.put(keys.version_record(1), b"{{}}")
loop = asyncio.new_event_loop()
relay = Relay(origin, RelayConfig(token="p", receiver_token="r", prefetch=False))
threading.Thread(target=loop.run_forever, daemon=True).start()
asyncio.run_coroutine_threadsafe(relay.start(), loop).result(30)
conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=30)
store = RelayStore(f"relay://127.0.0.1:{{relay.port}}", token="p")
{MUTATIONS}
""", """
from urllib.parse import quote

def one(i, kind, body):
    key = keys.receiver_key(f"r{i}") if kind == "registration" else keys.ack_key(1, f"r{i}")
    conn.request("PUT", "/o/" + quote(key), body=body, headers={"Authorization": "Bearer r"})
    r = conn.getresponse()
    answer = r.read()
    assert r.status < 500 and r.status in (200, 400, 413), (r.status, answer[:200])
    if r.status == 400:
        assert json.loads(answer)["error"], answer
    out = commit.read_receiver_records(store, kind, [key])
    assert (out[0] is not None) == (r.status == 200), (r.status, out)

import io, contextlib
with contextlib.redirect_stderr(io.StringIO()):
    for i, kind, body in mutants(67, 600):
        case(f"{kind}-{i}", lambda: one(i, kind, body))
""", expected="()")
    assert bad_results(got) == [], bad_results(got)[:3]
    assert got["hwm_mb"] < 256 and len(got["results"]) == 600, got["hwm_mb"]
