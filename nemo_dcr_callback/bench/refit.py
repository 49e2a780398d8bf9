"""`nemo-dcr bench refit`: end-to-end refit over a shaped link, dense vs DCR, in one run.

Sender and SeaweedFS (S3) in the root network namespace; the receiver in its own namespace,
joined by a veth pair shaped with tc tbf (default 100 Mbit/s each way), so the link, not the
delta computation, is the bottleneck, as between regions. A synthetic BF16 policy (default
~0.5G params = 1 GB) takes versions at 1, 3 and 5% change (--repeats versions each), of two
kinds (DELTAS), interleaved version by version: AdamW-like steps of fp32 masters (`rows`) and,
as the same run's control, the same rates at uniformly random positions
(`rows_by_deltas["uniform"]`); the table shows each rate's median version, `versions` every
one. For each step the DCR refit is timed from the end of the optimizer step
(BF16 weights ready) to the receiver's verified apply (every chunk checked, joint commit,
digests checked after applying). Each version's deltas are also encoded again off the path
with context coding, to show what share of the plain and of the context codec's ratio the
refit realises. Then the dense refit of the final weights goes through the same store: its
transport-only time (the checkpoint's bytes over the link, the reference the speed-ups use)
and its store-and-forward time (serialise, upload, download, load) are both reported, and
the receiver compares its DCR-built tensors with the dense download bit for bit (the oracle).
The sender is told the link's rate (dcr.link_mbit, as a user would set it for the receivers'
link; --no-link-hint: not), which `auto` context coding keeps ahead of: its own uploads go
to a store on its side of the link and never queue.

Needs root (ip netns, tc). Writes benchmarks/results/refit.json with --json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from nemo_dcr_callback.bench.links import JsonProc, ShapedLink
from nemo_dcr_callback.bench.results import machine, write_json

RATES = (0.01, 0.03, 0.05)
# adamw: an AdamW-like step of fp32 masters, BF16 copy (a value changes the more likely the
# smaller it is: what context coding exploits); uniform: the same share of values moved one
# ulp at uniformly random positions (no such dependence)
DELTAS = ("adamw", "uniform")
TARGETS = {0.01: 200, 0.03: 85, 0.05: 55}  # speed-up over the transport-only dense refit (issue 48)


# ------------------------------------------------------------------ receiver (in the namespace)
def receiver_main(args: list[str]) -> int:
    import argparse

    from safetensors.torch import load, load_file

    from nemo_dcr_callback.core.rawbits import bits
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.receiver import Follower
    from nemo_dcr_callback.receiver.follow import APPLY_MODES
    from nemo_dcr_callback.transport.store import freeze_long_lived, open_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--versions", type=int, required=True)
    ap.add_argument("--apply", choices=list(APPLY_MODES), default="sealed")
    a = ap.parse_args(args)
    torch.set_num_threads(2)
    store = open_store(a.url)
    tensors = {k: v.clone() for k, v in load_file(a.init).items()}
    f = Follower(store, tensors, version=0, receiver_id="rollout-0", poll_s=0.005, idle_poll_s=0.005,
                 early=APPLY_MODES[a.apply])  # polls S3 every 5 ms throughout: the figures are the transport's
    freeze_long_lived()  # as `nemo-dcr receive` does

    def out(d: dict) -> None:
        print(json.dumps(d), flush=True)

    model = {k: torch.empty_like(v) for k, v in tensors.items()}  # the dense path's model
    out({"ready": True})
    f.follow(until=a.versions, timeout=600, on_apply=lambda ap_: out({
        "version": ap_.version, "t_applied": time.time(), "fetch_s": ap_.fetch_s, "apply_s": ap_.apply_s,
        "wait_s": ap_.wait_s, "digest_checked": ap_.digest_checked, "bytes": ap_.bytes}))
    while not store.exists("dense/READY.json"):
        time.sleep(0.005)
    blob = store.get("dense/model.safetensors")
    t_got = time.time()  # the dense bytes crossed the link: the transport-only reference ends here
    dense = load(blob)
    for k, t in dense.items():  # the dense refit's load into a model's tensors
        model[k].copy_(t)
    t_loaded = time.time()
    mismatch = [k for k in dense if not torch.equal(bits(model[k]), bits(tensors[k]))]
    out({"dense_t_got": t_got, "dense_t_loaded": t_loaded, "dense_bytes": len(blob), "bit_exact": not mismatch,
         "mismatch": mismatch[:3]})
    commit.register(store, "rollout-0", a.versions)
    return 0


# ------------------------------------------------------------------ sender (root namespace)
def _ctx_share(taken, cur: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(plain, context) chunk bytes of one version's deltas, encoded again off the refit's path:
    the plain codec alone, and context coding tried per chunk (from the new bits, as the sender
    does) with the smaller kept."""
    from nemo_dcr_callback import codec  # (the module's imports stay light: the receiver runs it too)

    plain = ctx = 0
    for n, d in taken:
        if d.count:
            plain += sum(len(c) for c in codec.encode_delta(n, d))
            ctx += sum(len(c) for c in codec.encode_delta(n, d, current=cur[n]))
    return plain, ctx


def absorb(policy, prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> None:
    """Move the fp32 masters onto a uniform version's BF16 values, so that the next AdamW-like
    version's delta is that step's alone (not also the uniform one undone). Each moved value
    keeps its offset below the BF16 grid (master + the BF16 step) where that still rounds to
    the new value, so the next step's change rate stays the calibrated one."""
    for k, m in policy.master.items():
        old, new = prev[k].reshape(-1), cur[k].reshape(-1)
        moved = (old.view(torch.int16) != new.view(torch.int16)).nonzero().squeeze(1)
        if not moved.numel():
            continue
        flat = m.view(-1)
        target = new[moved].float()
        shifted = flat[moved] + (target - old[moved].float())
        keep = shifted.to(torch.bfloat16).view(torch.int16) == new[moved].view(torch.int16)
        flat[moved] = torch.where(keep, shifted, target)


def run(params: int = 1 << 29, mbit: float = 100.0, rates=RATES, part_bytes: int = 1 << 20,
        json_path: str | None = None, seed: int = 0, apply: str = "sealed", repeats: int = 3,
        deltas: tuple[str, ...] = DELTAS, context_share: bool = True, context: str = "auto",
        link_hint: bool = True, encode_threads: int | None = None) -> dict:
    from safetensors.torch import save, save_file

    from nemo_dcr_callback.bench.fp8 import ulp_step
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.recipes import synthetic
    from nemo_dcr_callback.testing.tensor_sender import TensorSender
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    t_start = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up namespaces and servers
    print(f"nemo-dcr bench refit: building a {params / 1e6:.0f}M-param synthetic policy ...", flush=True)
    policy = synthetic.make_policy(params, seed=seed)
    cur = policy.bf16()
    dense_bytes = sum(t.numel() * t.element_size() for t in cur.values())
    lrs = [policy.lr_for_rate(r) for r in rates] if "adamw" in deltas else [0.0] * len(rates)
    # versions in order: each rate's repeats with the kinds interleaved (adamw, uniform, adamw,
    # ...), so that a drift of the host's speed during the run moves both kinds alike
    plan = [(kind, rate, lr) for rate, lr in zip(rates, lrs, strict=True) for _ in range(repeats)
            for kind in deltas]
    work = Path(tempfile.mkdtemp(prefix="nemo-dcr-refit."))
    init = work / "init.safetensors"
    save_file(cur, str(init))
    rows = []
    with ShapedLink(mbit) as link, SeaweedS3(work / "s3", ip=link.ip_a) as s3:
        store = s3.store("refit")
        env = {**os.environ, **s3.env(), "PYTHONUNBUFFERED": "1"}
        rx = JsonProc(["ip", "netns", "exec", link.ns, sys.executable, "-m", "nemo_dcr_callback.bench.refit",
                       "receiver", "--url", s3.url(f"{s3.bucket}/refit"), "--init", str(init),
                       "--versions", str(len(plan)), "--apply", apply], env, work / "receiver.log")
        next_line = rx.next
        next_line()  # receiver ready (registered, holding version 0)
        sender = TensorSender(cur, context=context, link_mbit=mbit if link_hint else None,
                              encode_threads=encode_threads)
        print(f"link {mbit:.0f} Mbit/s (tbf, veth between namespaces), model {dense_bytes / 1e9:.2f} GB BF16, "
              f"S3 = SeaweedFS at {s3.endpoint}", flush=True)
        for v, (kind, rate, lr) in enumerate(plan, start=1):
            prev = cur
            if kind == "adamw":
                policy.step(lr)
                cur = policy.bf16()
            else:
                cur = ulp_step(prev, rate, seed=seed + v)
                if "adamw" in deltas:
                    absorb(policy, prev, cur)
            t0 = time.time()  # end of the optimizer step: the BF16 weights are there
            sender.tensors = cur
            taken, m = sender.stream(store, v, v - 1, part_bytes=part_bytes)  # kernel + encode + upload
            t_built = time.time()
            rec = commit.seal_version(store, v, v - 1, 1)
            d = commit.run_commit(store, rec, commit.CommitPolicy("wait", timeout=600, poll=0.005))
            if d["decision"] != "commit":
                raise RuntimeError(f"version {v} not committed: {d['reason']}")
            sender.settle()
            got = next_line()
            e2e = got["t_applied"] - t0
            changed = sum(dd.count for _, dd in taken)
            # a part is its chunks back to back: the bytes sent are chunk bytes
            plain_b, ctx_b = _ctx_share(taken, cur) if context_share else (m["bytes"], m["bytes"])
            rows.append({"version": v, "deltas": kind, "target_rate": rate, "change_rate": changed / policy.numel,
                         "context_on_path": context, "plain_bytes": plain_b, "ctx_bytes": ctx_b,
                         "ctx_ratio": dense_bytes / max(ctx_b, 1), "delta_bytes": m["bytes"],
                         "path_ratio": dense_bytes / max(m["bytes"], 1), "codec_ratio": dense_bytes / max(plain_b, 1),
                         "construct_s": t_built - t0, "e2e_s": e2e,
                         "receiver_fetch_s": got["fetch_s"], "receiver_apply_s": got["apply_s"],
                         "commit_wait_s": got["wait_s"], "digest_checked": got["digest_checked"]})
            print(f"  DCR {kind} {100 * rate:.0f}%: {m['bytes'] / 1e6:.1f} MB sent (plain codec: "
                  f"{plain_b / 1e6:.1f} MB, context: {ctx_b / 1e6:.1f} MB), built in {t_built - t0:.2f} s, "
                  f"applied+verified at the receiver {e2e:.2f} s after the step", flush=True)
        # dense refit of the final weights through the same store
        print("  dense refit (upload + download of the full checkpoint) ...", flush=True)
        t0 = time.time()
        store.put("dense/model.safetensors", save(cur))
        t_up = time.time()
        store.put("dense/READY.json", b"{}")
        got = next_line()
        dense_s = got["dense_t_loaded"] - t0  # store and forward: serialise, upload, download, load
        dense_transport_s = got["dense_t_got"] - t_up  # the dense checkpoint's bytes over the same link
        rx.p.wait(60)
    link_bps = mbit * 1e6 / 8
    versions = rows
    for r in versions:
        transfer = r["delta_bytes"] / (got["dense_bytes"] / dense_transport_s)
        speedup = dense_transport_s / r["e2e_s"]
        r.update({"dense_s": dense_s, "dense_transport_s": dense_transport_s, "speedup": speedup,
                  "speedup_store_forward": dense_s / r["e2e_s"], "realized": speedup / r["codec_ratio"],
                  "realized_ctx": speedup / r["ctx_ratio"], "transfer_s": transfer,
                  "overlap": r["e2e_s"] / max(r["construct_s"], transfer),
                  "target_speedup": TARGETS.get(r["target_rate"])})
    by_kind = {}  # per kind and change rate: the median version (by refit time) of its repeats, and every time
    for kind in deltas:
        by_kind[kind] = []
        for rate in rates:
            rs = sorted((r for r in versions if r["target_rate"] == rate and r["deltas"] == kind),
                        key=lambda r: r["e2e_s"])
            by_kind[kind].append({**rs[(len(rs) - 1) // 2], "repeats": len(rs),
                                  "e2e_s_all": [r["e2e_s"] for r in rs]})
    rows = by_kind.get("adamw") or by_kind[deltas[0]]
    res = {"benchmark": "refit", "params": policy.numel, "dense_bytes": dense_bytes, "link_mbit": mbit,
           "link_bytes_per_s": link_bps, "dense_s": dense_s, "dense_upload_s": t_up - t0,
           "dense_transport_s": dense_transport_s, "rows_by_deltas": by_kind,
           "dense_bit_exact_with_dcr": got["bit_exact"], "part_bytes": part_bytes, "apply": apply, "context": context,
           "link_hint_mbit": mbit if link_hint else None, "encode_threads": sender.encode_threads,
           "repeats": repeats, "rows": rows, "versions": versions,
           "machine": machine(), "wall_s": time.time() - t_start}
    print(f"\nmedian of {repeats} version(s) per change rate (receiver apply: {apply}); dense: "
          f"{dense_transport_s:.1f} s over the link (transport only), {dense_s:.1f} s store and forward")
    print(f"{'deltas':>7} {'change':>7} {'sent MB':>8} {'sent':>7} {'plain':>7} {'context':>8} {'DCR s':>7} "
          f"{'speed-up':>9} {'target':>7} {'s&f':>7} {'of plain':>9} {'of ctx':>7} {'overlap':>8}")
    for kind in deltas:
        for r in by_kind[kind]:
            print(f"{kind:>7} {100 * r['change_rate']:6.2f}% {r['delta_bytes'] / 1e6:8.2f} {r['path_ratio']:6.1f}x "
                  f"{r['codec_ratio']:6.1f}x {r['ctx_ratio']:7.1f}x {r['e2e_s']:7.2f} {r['speedup']:8.1f}x "
                  f"{r['target_speedup'] or '-':>6}x "
                  f"{r['speedup_store_forward']:6.1f}x {100 * r['realized']:8.0f}% {100 * r['realized_ctx']:6.0f}% "
                  f"{r['overlap']:8.2f}")
    print(f"receiver's DCR-built weights bit-exact with the dense download: {got['bit_exact']}; "
          f"{dense_bytes / 1e9:.2f} GB over {mbit:.0f} Mbit/s")
    shutil.rmtree(work, ignore_errors=True)  # a GB or more of checkpoints and store data per run
    if json_path:
        write_json(json_path, res)
    if not got["bit_exact"]:
        raise RuntimeError(f"receiver differs from the dense refit in {got['mismatch']}")
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        sys.exit(receiver_main(sys.argv[2:]))
    run()
