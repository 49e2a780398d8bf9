"""`nemo-dcr bench codec --real`: whole-payload sizes on real-gradient checkpoint pairs.

Synthetic deltas have a few large tensors and hide per-tensor costs. Here every figure counts
every byte a receiver downloads (the whole delta file: chunks with their headers, the
manifest, the footer), on the corpus of bench/corpus.py (a 147-tensor Qwen2-shaped model
and a 1,209-tensor MoE, one AdamW step at about 1% and 4% change), against:
- the per-tensor order-0 XOR bound: n H(p) for the positions plus the order-0 information of
  the XOR values, tensor by tensor (what `stats` calls the XOR bound);
- the conditional-entropy figure: the same with each position's changed bit and each value
  conditioned on the old value's exponent, statistics per exponent shared by the version's
  tensors (what the context-modelled coding aims at; no model cost counted).
Decode + apply runs in memory on one core, beside a dense copy of the same weights; the
refit row publishes a version of a 100M-parameter model through the sender path over whole
tensors (TensorSender: the Publisher's chunks, parts and records, without placement) and
counts what is not chunk payload (chunk headers, part and rank manifests, the version record).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.bench import corpus
from nemo_dcr_callback.bench.results import machine, write_json
from nemo_dcr_callback.codec import context
from nemo_dcr_callback.core.bitops import ulp_diff_reference
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.tools import deltafile

TARGETS = {"whole_vs_xor_bound_plain": 0.97, "whole_vs_xor_bound_context": 1.25, "decode_apply_vs_memcpy": 0.5,
           "refit_non_payload": 0.02}


def _h(c: float, n: float) -> float:
    if c <= 0 or c >= n:
        return 0.0
    p = c / n
    return n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _info(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum()) if c.size else 0.0


def bounds(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """Bytes: the per-tensor order-0 XOR and ulp bounds, and the conditional-entropy figure
    (positions and ulp values given the old exponent, per-exponent statistics shared by all
    tensors of the pair)."""
    xor0 = ulp0 = 0.0
    n_e, c_e = np.zeros(256), np.zeros(256)
    vals: dict[int, list[np.ndarray]] = {}
    for name, o in old.items():
        info = codec.dtype_info(o.dtype)
        a, b = bits(o).reshape(-1), bits(new[name]).reshape(-1)
        x = a ^ b
        ch = (x != 0).numpy()
        n, c = ch.size, int(ch.sum())
        pos = _h(c, n)
        xor0 += pos
        ulp0 += pos
        if not c:
            continue
        xv = x.numpy()[ch]
        xor0 += codec.values_info_bits(torch.from_numpy(xv))
        u = ulp_diff_reference(a[torch.from_numpy(ch)], b[torch.from_numpy(ch)]).numpy()
        ulp0 += codec.values_info_bits(torch.from_numpy(u))
        if context.supported(info.name):
            e = context.exponents(a, info.name)
            n_e += np.bincount(e, minlength=256)[:256]
            c_e += np.bincount(e[ch], minlength=256)[:256]
            for v in np.unique(e[ch]):
                vals.setdefault(int(v), []).append(u[e[ch] == v].astype(np.int64))
    cond = sum(_h(c_e[i], n_e[i]) for i in range(256))
    cond += sum(_info(np.unique(np.concatenate(v), return_counts=True)[1]) for v in vals.values())
    return {"xor_bound": xor0 / 8, "ulp_bound": ulp0 / 8, "conditional": cond / 8}


def _decode_apply(delta: Path, old: dict, new: dict, reps: int) -> tuple[float, list[float], list[float], dict]:
    """Seconds to decode and apply every chunk of a delta file in memory (one core): the median,
    and per rep a dense refit of the same targets (a copy of the new weights into them) timed
    just before it, and their ratio. Each starts from the targets reset to the old weights.
    This VM's speed drifts by 2x over minutes; the two timed back to back see the same drift."""
    df = deltafile.DeltaFile(delta)
    off, blobs = 8, []
    for n in df.manifest["chunk_lengths"]:
        blobs.append(df.read([off, n]))
        off += n
    df.close()
    flat = {k: v.clone().reshape(-1) for k, v in old.items()}
    src = {k: v.reshape(-1) for k, v in new.items()}

    def reset():
        for k, v in old.items():
            flat[k].copy_(v.reshape(-1))

    times, copies, ratios = [], [], []
    # Timed with the heap frozen, as receivers run (freeze_long_lived): a full collection here
    # scanned the corpus's models and torch's objects inside the timed decode (docs/PERFORMANCE.md).
    gc.collect()
    gc.freeze()
    try:
        for _ in range(max(reps, 5)):
            reset()
            t0 = time.perf_counter()
            for k, v in src.items():
                flat[k].copy_(v)
            t1 = time.perf_counter()
            reset()
            t2 = time.perf_counter()
            for b in blobs:
                h = codec.parse_header(b)
                parts = codec.decode_parts(b, h, old=lambda m: flat[m.name])
                codec.apply_all(parts, [flat[d.header.name] for d in parts])
            t3 = time.perf_counter()
            copies.append(t1 - t0)
            times.append(t3 - t2)
            ratios.append((t1 - t0) / (t3 - t2))
    finally:
        gc.unfreeze()
    return statistics.median(times), copies, ratios, flat


def pair_row(p: corpus.Pair, work: Path, reps: int) -> dict:
    d = work / f"{p.kind}-{p.target}"
    corpus.save(p.old, d / "old" / "model.safetensors")
    corpus.save(p.new, d / "new" / "model.safetensors")
    b = bounds(p.old, p.new)
    dense = sum(t.numel() * t.element_size() for t in p.new.values())
    row = {"kind": p.kind, "target_rate": p.target, "change_rate": p.rate, "lr": p.lr, "tensors": len(p.old),
           "params": sum(t.numel() for t in p.old.values()), "dense_bytes": dense, **{f"{k}_bytes": v
                                                                                      for k, v in b.items()}}
    t_copy = []
    for label, ctx in (("plain", False), ("context", True)):
        out = d / f"{label}.dcr"
        t_enc = []
        for _ in range(reps):
            t0 = time.perf_counter()
            deltafile.diff(d / "old", d / "new", out, quiet=True, force=True, context=ctx)
            t_enc.append(time.perf_counter() - t0)
        st = deltafile.stats(out)
        t_dec, copies, ratios, got = _decode_apply(out, p.old, p.new, reps)
        t_copy += copies
        for k, v in p.new.items():  # the oracle: the new BF16 weights themselves
            if not torch.equal(bits(got[k]), bits(v).reshape(-1)):
                raise AssertionError(f"{label}: {k} is not bit-exact after decode and apply")
        row[label] = {
            "bytes": st["bytes"], "payload_bytes": st["payload_bytes"], "non_payload_bytes": st["non_payload_bytes"],
            "whole_vs_xor_bound": b["xor_bound"] / st["bytes"], "whole_vs_conditional": b["conditional"] / st["bytes"],
            "payload_vs_xor_bound": b["xor_bound"] / st["payload_bytes"],
            "diff_s": statistics.median(t_enc), "decode_apply_s": t_dec,
            "decode_apply_gbps": dense / t_dec / 1e9,
            "memcpy_gbps": dense / statistics.median(copies) / 1e9,
            "decode_apply_vs_memcpy": statistics.median(ratios),  # each rep against its own copy
        }
    row["memcpy_gbps"] = dense / statistics.median(t_copy) / 1e9
    return row


RECEIVED = ("part", "rank_manifest", "record", "decision")  # what every receiver downloads per version


def refit_row(p: corpus.Pair, work: Path) -> dict:
    """One version of the pair through the sender path over whole tensors (TensorSender, FileStore, seal,
    commit): every object of the version a receiver downloads, and what in it is not chunk
    payload."""
    from nemo_dcr_callback.protocol import commit, keys
    from nemo_dcr_callback.testing.tensor_sender import publish
    from nemo_dcr_callback.transport.store import FileStore

    store = FileStore(work / "store")
    publish(store, 1, 0, p.old, p.new)
    total = parts = headers = 0
    for k in store.list(commit.vdir(1)):
        if keys.kind(k) not in RECEIVED:  # the sealer's sums, acks: not what a receiver downloads
            continue
        data = store.get(k)
        total += len(data)
        if k.endswith(".dcr"):
            parts += len(data)
            headers += sum(codec.parse_header(c).payload_offset + codec.format.SUM_BYTES
                           for c in codec.split_chunks(data))
    payload = parts - headers
    return {"kind": p.kind, "params": sum(t.numel() for t in p.old.values()), "tensors": len(p.old),
            "change_rate": p.rate, "version_bytes": total, "chunk_payload_bytes": payload,
            "chunk_header_bytes": headers, "manifest_and_record_bytes": total - parts,
            "non_payload_fraction": (total - payload) / total}


def format_table(rows: list[dict], refit: list[dict]) -> str:
    out = ["whole delta file vs bounds (efficiency = bound / bytes; pay: payload only; cond = conditional-entropy"
           " figure);"
           " decode+apply GB/s of dense BF16 per core, beside memcpy; x copy: the median of each rep's"
           " copy time over its decode + apply time",
           f"{'pair':>9} {'rate':>6} {'tensors':>7} {'xor bound':>10} {'cond':>9} {'plain':>9} {'eff':>6} {'pay':>6} "
           f"{'context':>9} {'eff':>6} {'vs cond':>7} {'dec plain':>9} {'dec ctx':>8} {'memcpy':>7} "
           f"{'x copy':>6} {'ctx x':>6}"]
    for r in rows:
        pl, cx = r["plain"], r["context"]
        out.append(f"{r['kind']:>9} {r['change_rate']:6.2%} {r['tensors']:7d} {r['xor_bound_bytes'] / 1e3:8.1f}KB "
                   f"{r['conditional_bytes'] / 1e3:7.1f}KB {pl['bytes'] / 1e3:7.1f}KB {pl['whole_vs_xor_bound']:6.3f} "
                   f"{pl['payload_vs_xor_bound']:6.3f} "
                   f"{cx['bytes'] / 1e3:7.1f}KB {cx['whole_vs_xor_bound']:6.3f} {cx['whole_vs_conditional']:7.3f} "
                   f"{pl['decode_apply_gbps']:9.2f} {cx['decode_apply_gbps']:8.2f} {r['memcpy_gbps']:7.2f} "
                   f"{pl['decode_apply_vs_memcpy']:6.2f} {cx['decode_apply_vs_memcpy']:6.2f}")
    for r in refit:
        out.append(f"refit path, {r['params'] / 1e6:.0f}M params, {r['tensors']} tensors at {r['change_rate']:.2%}: "
                   f"{r['version_bytes'] / 1e3:.1f} KB per version, chunk headers "
                   f"{r['chunk_header_bytes'] / 1e3:.1f} KB + manifests and records "
                   f"{r['manifest_and_record_bytes'] / 1e3:.1f} KB = "
                   f"{r['non_payload_fraction']:.2%} not payload")
    return "\n".join(out)


def run(reps: int = 3, kinds: tuple[str, ...] = ("dense", "moe"), rates: tuple[float, ...] = (0.01, 0.04),
        refit: bool = True, json_path: str | None = None, quiet: bool = False) -> dict:
    torch.set_num_threads(1)
    os.environ["NEMO_DCR_THREADS"] = "1"
    if hasattr(os, "sched_setaffinity"):  # one core, no migrations: steadier per-core figures
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    rows, refits = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kind in kinds:
            if not quiet:
                print(f"nemo-dcr bench codec --real: training the {kind} corpus model ...", flush=True)
            for p in corpus.pairs(kind, rates):
                rows.append(pair_row(p, work, reps))
        if refit:
            if not quiet:
                print("nemo-dcr bench codec --real: training the 100M model for the refit row ...", flush=True)
            (p,) = corpus.pairs("dense100m", (0.01,), steps=2)
            refits.append(refit_row(p, work))
    out = {"benchmark": "codec_real", "machine": machine(), "reps": reps, "targets": TARGETS, "results": rows,
           "refit": refits}
    print(format_table(rows, refits))
    if json_path:
        write_json(json_path, out)
    return out
