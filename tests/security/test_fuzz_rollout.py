"""Fuzzing the trainer's reader of one rollout batch (issue 66, finding 9): rl_task.read_batch,
which RolloutQueue.take calls for every file the worker (or anyone who can write the rollout
folder) puts there.

A few hundred batches mutated from a valid one, with a fixed seed: fields of the wrong type,
huge and negative numbers, NaN and infinities, nesting, fields missing, long token lists, many
episodes, bytes that are no JSON. Each runs in a subprocess whose address space is capped
(tests/helpers/capped.py): the reader must accept it or refuse it with BadBatch (a
ValueError), never a traceback or a MemoryError, and what it accepts must make a token batch
the policy gradient can train on (rl_task.batch), the trainer's next step."""

from __future__ import annotations

from tests.helpers.capped import bad_results, run_capped

SETUP = """
import copy, json, math, os, random, tempfile
import torch
from nemo_dcr_callback.recipes import rl_task

torch.set_num_threads(1)
rl_task.batch([rl_task.first_turn(1, 2, 11, 0, 0)], 1)  # (torch's first use, before the cap)
FOLDER = tempfile.mkdtemp()
CURRENT, MAX_TOKENS, VOCAB = 5, rl_task.SEQ + 1, 250
"""

BODY = r"""
rng = random.Random(66)
D = rl_task.DIGIT0


def valid():
    eps = []
    for g in range(4):
        for k in range(2):
            e = rl_task.first_turn(rng.randrange(10), rng.randrange(10), D + rng.randrange(10), 3, g)
            if e.tokens[-1] != rl_task.RIGHT:
                rl_task.second_turn(e, D + rng.randrange(10))
            eps.append(e.to_json())
    return {"batch": 0, "version": 3, "episodes": eps, "gen_s": 0.1, "tokens": 12, "time": 1.0}


def nest(depth, leaf=0):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


ODD = [None, True, False, -1, 0, 1, 2**31, 2**63, 10**30, -(10**30), 1e18, -1e18, 0.5, float("nan"),
       float("inf"), float("-inf"), "", "3", "x" * 1000, [], {}, [1, 2], {"a": 1}, nest(50), nest(300),
       [0] * 10000, [D] * 50, [10**6], [-5], [1.5], [True], ["1"], [None]]


def paths(b):
    # every place a value can be swapped: the batch's fields, an episode, an episode's fields
    out = [("batch", k) for k in b] + [("episodes", None)]
    for i, e in enumerate(b["episodes"]):
        out += [("episode", i)] + ([("field", i, f) for f in e] if isinstance(e, dict) else [])
    return out


def mutate(b):
    b = copy.deepcopy(b)
    for _ in range(rng.choice([1, 1, 2, 3])):
        p = rng.choice(paths(b)) if isinstance(b.get("episodes"), list) and b["episodes"] else ("batch", "version")
        how = rng.random()
        if p[0] == "batch":
            if how < 0.2:
                b.pop(p[1], None)
            else:
                b[p[1]] = copy.deepcopy(rng.choice(ODD))
        elif p[0] == "episodes":
            b["episodes"] = copy.deepcopy(rng.choice(ODD)) if how < 0.5 else b["episodes"] * rng.choice([0, 50, 500])
        elif p[0] == "episode":
            b["episodes"][p[1]] = copy.deepcopy(rng.choice(ODD))
        else:
            e = b["episodes"][p[1]]
            if how < 0.2:
                e.pop(p[2], None)
            elif how < 0.3 and isinstance(e[p[2]], list):
                e[p[2]] = e[p[2]] + [copy.deepcopy(rng.choice(ODD))]
            elif how < 0.4 and isinstance(e[p[2]], list):
                e[p[2]] = e[p[2]] * rng.choice([2, 10, 10000])
            else:
                e[p[2]] = copy.deepcopy(rng.choice(ODD))
    return b


def check(data):
    with open(rl_task.batch_path(FOLDER, 0), "wb") as f:
        f.write(data)
    got = rl_task.read_batch(FOLDER, 0, CURRENT, MAX_TOKENS, VOCAB)
    assert 0 <= got["version"] <= CURRENT and got["episodes"], got
    eps = [rl_task.Episode.from_json(e) for e in got["episodes"]]
    tokens, weights = rl_task.batch(eps, 1)  # what the trainer does next: must not raise
    assert bool(torch.isfinite(weights).all())


def enc(b):
    return json.dumps(b).encode()  # (NaN and Infinity as JSON's extension, which json.loads reads)


base = valid()
case("valid", lambda: check(enc(base)))
for n in range(360):
    m = mutate(base)
    case(f"mutated-{n}", lambda m=m: check(enc(m)))
raw = enc(base)
for n in range(40):  # bytes: truncated, flipped, spliced
    r = bytearray(raw)
    k = rng.randrange(len(r))
    if n % 3 == 0:
        r = r[:k]
    elif n % 3 == 1:
        r[k] = rng.randrange(256)
    else:
        r[k:k] = rng.choice([b"[" * 5000, b"9" * 5000, b"\x00", b"\xff\xfe", b'"\\ud800"', b"NaN", b"-Infinity"])
    case(f"bytes-{n}", lambda r=bytes(r): check(r))
case("nested-deep", lambda: check(b"[" * 200000 + b"]" * 200000))
case("nested-object", lambda: check(b'{"version": 1, "episodes": ' + b"[" * 200000 + b"]" * 200000 + b"}"))
case("digits", lambda: check(b'{"version": ' + b"9" * 100000 + b', "episodes": []}'))
fill = rl_task.BATCH_MAX - 40
case("empty-objects", lambda: check(b'{"version": 1, "episodes": [' + b"{}," * (fill // 3) + b"{}]}"))
case("small-ints", lambda: check(b'{"version": 1, "episodes": [' + b"0," * (fill // 2) + b"0]}"))
one = json.dumps(base["episodes"][0]).encode()
case("many-episodes", lambda: check(b'{"version": 3, "episodes": [' + b",".join([one] * (fill // (len(one) + 1)))
                                    + b"]}"))
case("long-tokens", lambda: check(enc({"version": 3, "episodes": [dict(base["episodes"][0],
                                                                      tokens=[D] * 500000)]})))
case("too-large", lambda: check(b" " * (rl_task.BATCH_MAX + 1)))
"""


def test_rollout_batches_are_checked_never_a_traceback_within_memory():
    got = run_capped(SETUP, BODY)
    assert bad_results(got) == []
    kinds = [r[1] for r in got["results"]]
    assert len(kinds) > 400 and kinds.count("ok") > 50 and kinds.count("error") > 50, kinds
    assert got["hwm_mb"] < 256, got["hwm_mb"]
