"""The device check of the CUDA kernels: correctness against the CPU reference, then timings
against a device-to-device copy of the same bytes. Run by scripts/device_check.sh (or
`nemo-dcr bench cuda`, or `python -m nemo_dcr_callback.bench.cuda`); needs a CUDA GPU.

Imports only torch and the leaf modules (delta, kernels, cuda_kernels), so it runs under a
GPU image's own Python without the package's other dependencies installed.

GB/s are of input: the tensor's bytes (n x element size) over the time, for the copy, the
delta pass and the apply alike, so the ratios compare one shard's handling with copying it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from nemo_dcr_callback.bench.results import RESULTS, write_json
from nemo_dcr_callback.core import bitops, cuda_kernels, delta, kernels
from nemo_dcr_callback.core.rawbits import bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64]
TARGETS = {"delta": 0.70, "apply": 0.50}  # of the measured copy bandwidth (issue 8)
_MASK_HI = {1: 1 << 7, 2: 1 << 15, 4: 1 << 31, 8: 1 << 62}


# ------------------------------------------------------------------ data
def random_pair(n: int, dtype: torch.dtype, rate: float, gen: torch.Generator, dev: str = "cuda"):
    """(old, new): random values, `rate` of the elements with random bits flipped."""
    if dtype.is_floating_point:
        old = (torch.randn(n, generator=gen, device=dev) * 0.02).to(dtype)
    else:
        old = torch.randint(-100, 100, (n,), generator=gen, device=dev).to(dtype)
    new = old.clone()
    if n == 0 or rate == 0:
        return old, new
    b = bits(new)
    mask = torch.rand(n, generator=gen, device=dev) < rate if rate < 1 else torch.ones(n, dtype=torch.bool, device=dev)
    w = old.element_size()
    flips = torch.randint(1, _MASK_HI[w], (n,), generator=gen, device=dev).to(b.dtype)
    b.copy_(torch.where(mask, b ^ flips, b))
    return old, new


def _adam_like(w: torch.Tensor, lr: float, gen: torch.Generator) -> torch.Tensor:
    return (w + lr * torch.randn(w.shape, generator=gen, device=w.device)).to(torch.bfloat16)


def realistic_pair(n: int, rate: float, gen: torch.Generator, dev: str = "cuda"):
    """BF16 weights from fp32 master weights N(0, 0.02) and an Adam-like step (every element
    moves by lr x N(0, 1)): only the elements whose BF16 rounding moves change, mostly by one
    ulp (XOR carry chains). lr is searched so that about `rate` of the BF16 patterns change."""
    sample = torch.randn(1 << 20, generator=gen, device=dev) * 0.02
    lo, hi = 1e-9, 1e-1
    for _ in range(40):
        lr = (lo * hi) ** 0.5
        got = (_adam_like(sample, lr, gen) != sample.to(torch.bfloat16)).float().mean().item()
        lo, hi = (lr, hi) if got < rate else (lo, lr)
    master = torch.randn(n, generator=gen, device=dev) * 0.02
    old = master.to(torch.bfloat16)
    new = _adam_like(master, (lo * hi) ** 0.5, gen)
    return old, new


# ------------------------------------------------------------------ checks
class Checks:
    def __init__(self):
        self.cases, self.failures = 0, []

    def run(self, name: str, fn) -> None:
        self.cases += 1
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the run
            self.failures.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"  FAIL {name}: {exc}", flush=True)
            traceback.print_exc(limit=3)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or not torch.equal(a, b):
        raise AssertionError(f"{what} differs ({tuple(a.shape)} vs {tuple(b.shape)})")


def check_delta(old, new, keep_new, *, offset=0, base_offset=None, cap=None, pos64=None, scalar=False,
                baseline="gpu", out="device") -> None:
    """One take_delta_cuda against delta.take_delta_reference on CPU copies."""
    n = old.numel()
    base_offset = offset if base_offset is None else base_offset
    cur_buf = torch.empty(n + offset, dtype=new.dtype, device=new.device)
    cur = cur_buf[offset:offset + n]
    cur.copy_(new)
    if baseline == "pinned":
        base_buf = torch.empty(n + base_offset, dtype=old.dtype, pin_memory=True)
    else:
        base_buf = torch.empty(n + base_offset, dtype=old.dtype, device=new.device)
    base = base_buf[base_offset:base_offset + n]
    base.copy_(old)
    ref_base = old.cpu().clone()
    ref = delta.take_delta_reference(new.cpu(), ref_base, keep_new=keep_new)
    got = cuda_kernels.take_delta_cuda(cur, base, keep_new=keep_new, out=out, cap=cap, pos64=pos64, scalar=scalar)
    torch.cuda.synchronize()
    want_dev = "cpu" if out == "pinned" else "cuda"
    if got.positions.device.type != want_dev:
        raise AssertionError(f"positions on {got.positions.device}, expected {want_dev}")
    if pos64:
        if got.positions.dtype != torch.int64:
            raise AssertionError("pos64 did not give int64 positions")
        _equal(got.positions, ref.positions.to(torch.int64), "positions")
    else:
        if got.positions.dtype != ref.positions.dtype:
            raise AssertionError(f"positions dtype {got.positions.dtype} != {ref.positions.dtype}")
        _equal(got.positions, ref.positions, "positions")
    _equal(got.xor, ref.xor, "xor values")
    if keep_new:
        _equal(got.new, ref.new, "new values")
    elif got.new is not None:
        raise AssertionError("new values returned without keep_new")
    _equal(bits(base), bits(ref_base), "baseline after the pass")
    _equal(bits(cur), bits(new), "current (must be untouched)")
    # The undo log restores the previous baseline bit for bit (scatter XOR, on the device too).
    delta.undo(base, got)
    torch.cuda.synchronize()
    _equal(bits(base), bits(old), "baseline after undo")


def check_scatter(n: int, dtype: torch.dtype, op: int, rate: float, gen: torch.Generator, *, pos64=False,
                  host_inputs=False) -> None:
    old, new = random_pair(n, dtype, rate, gen)
    t_ref = bits(old.cpu().clone())
    ref_delta = delta.take_delta_reference(new.cpu(), old.cpu().clone(), keep_new=True)
    pos = ref_delta.positions.to(torch.int64) if pos64 else ref_delta.positions
    if op == bitops.OP_XOR:
        vals = ref_delta.xor
    elif op == bitops.OP_OVERWRITE:
        vals = ref_delta.new
    elif dtype.itemsize == 8:  # the torch ulp reference covers widths 2 and 4: the compiled CPU kernel
        lib = kernels.native()
        if lib is None:
            raise RuntimeError("width-8 ulp check needs the compiled CPU kernels (g++)")
        vals = torch.empty_like(ref_delta.xor)
        lib.dcr_ulp_encode(ref_delta.xor.data_ptr(), ref_delta.new.data_ptr(), ref_delta.count, 8, vals.data_ptr())
    else:
        vals = bitops.ulp_diff_reference(t_ref[pos.long()], ref_delta.new)
    if op == bitops.OP_ULP and dtype.itemsize == 8:
        bitops.scatter(t_ref, pos, vals, op)  # the compiled CPU kernel
    else:
        bitops.scatter_reference(t_ref, pos, vals, op)
    target = old.clone()
    p, v = (pos, vals) if host_inputs else (pos.cuda(), vals.cuda())
    bitops.scatter(target, p, v, op)
    torch.cuda.synchronize()
    _equal(bits(target), t_ref, f"target after op {op}")
    if op != bitops.OP_XOR:
        _equal(bits(target), bits(new), f"target after op {op} vs new")


def check_refusals(gen: torch.Generator) -> None:
    t = torch.arange(100, dtype=torch.float32, device="cuda")
    before = t.clone()
    bad = {"unsorted": [5, 3], "duplicate": [4, 4], "negative": [-1, 2], "beyond": [10, 100]}
    for name, p in bad.items():
        for dt in (torch.int32, torch.int64):
            try:
                bitops.scatter(t, torch.tensor(p, dtype=dt), torch.ones(2, dtype=torch.float32), bitops.OP_XOR)
            except ValueError:
                pass
            else:
                raise AssertionError(f"scatter accepted {name} positions")
            _equal(bits(t), bits(before), f"target after refused {name}")
    try:
        small = torch.zeros(8, dtype=torch.int8, device="cuda")
        bitops.scatter(small, torch.tensor([1]), torch.ones(1, dtype=torch.int8), bitops.OP_ULP)
    except ValueError:
        pass
    else:
        raise AssertionError("ulp scatter accepted width 1")
    bitops.scatter(t, torch.empty(0, dtype=torch.int64), torch.empty(0), bitops.OP_XOR)  # empty: a no-op
    _equal(bits(t), bits(before), "target after an empty scatter")


def check_side_stream(gen: torch.Generator) -> None:
    """The sender's path: side stream, pinned outputs, GPU and pinned baselines, odd phase."""
    for where in ("gpu", "pinned"):
        old, new = realistic_pair(1_000_003, 0.03, gen)
        shard_buf = torch.empty(1_000_003 + 3, dtype=torch.bfloat16, device="cuda")
        shard = shard_buf[3:]
        shard.copy_(old)
        base = cuda_kernels.place_baseline(shard.clone(), where, like=shard)
        if (base.data_ptr() - shard.data_ptr()) % 16:
            raise AssertionError("place_baseline did not match the shard's 16-byte phase")
        shard.copy_(new)
        ref = delta.take_delta_reference(new.cpu(), old.cpu().clone(), keep_new=True)
        side = cuda_kernels.SideStream()
        d = side.take(shard, base)
        if d.positions.device.type != "cpu" or not d.positions.is_pinned():
            raise AssertionError("side-stream deltas must be in pinned host memory")
        _equal(d.positions, ref.positions, f"{where}: positions")
        _equal(d.xor, ref.xor, f"{where}: xor")
        _equal(d.new, ref.new, f"{where}: new")
        _equal(bits(base), bits(new), f"{where}: baseline")


def run_checks(seed: int = 0) -> Checks:
    ck = Checks()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sizes = [0, 1, 7, 31, 1000, 2049, 8191, 65537, 1_000_003]
    t0 = time.perf_counter()
    for dtype in DTYPES:
        for n in sizes:
            for rate in (0.0, 0.01, 0.3, 1.0):
                old, new = random_pair(n, dtype, rate, gen)
                for keep_new in (False, True):
                    ck.run(f"delta {dtype} n={n} rate={rate} new={keep_new}",
                           lambda o=old, w=new, k=keep_new: check_delta(o, w, k))
                ck.run(f"delta {dtype} n={n} rate={rate} offset=3",
                       lambda o=old, w=new: check_delta(o, w, True, offset=3))
                ck.run(f"delta {dtype} n={n} rate={rate} phases differ",
                       lambda o=old, w=new: check_delta(o, w, True, offset=1, base_offset=0))
        old, new = random_pair(300_001, dtype, 1.0, gen)
        ck.run(f"delta {dtype} 100% rounds", lambda o=old, w=new: check_delta(o, w, True, cap=1))
        old, new = random_pair(300_001, dtype, 0.3, gen)
        ck.run(f"delta {dtype} 30% rounds offset", lambda o=old, w=new: check_delta(o, w, True, cap=20_000, offset=5))
        ck.run(f"delta {dtype} scalar path", lambda o=old, w=new: check_delta(o, w, True, scalar=True))
        ck.run(f"delta {dtype} int64 positions", lambda o=old, w=new: check_delta(o, w, True, pos64=True))
        ck.run(f"delta {dtype} pinned baseline", lambda o=old, w=new: check_delta(o, w, True, baseline="pinned",
                                                                                   offset=2))
        ck.run(f"delta {dtype} pinned out", lambda o=old, w=new: check_delta(o, w, True, out="pinned"))
        for op in (bitops.OP_XOR, bitops.OP_OVERWRITE, bitops.OP_ULP):
            if op == bitops.OP_ULP and dtype.itemsize == 1:
                continue
            for n in (1, 4097, 1_000_003):
                ck.run(f"scatter {dtype} op={op} n={n}",
                       lambda d=dtype, o=op, k=n: check_scatter(k, d, o, 0.05, gen))
            ck.run(f"scatter {dtype} op={op} int64 host inputs",
                   lambda d=dtype, o=op: check_scatter(100_003, d, o, 0.5, gen, pos64=True, host_inputs=True))
    for rate in (0.01, 0.03, 0.05):
        old, new = realistic_pair(4_000_037, rate, gen)
        got = (bits(old) != bits(new)).float().mean().item()
        ck.run(f"delta realistic bf16 rate={got:.4f}", lambda o=old, w=new: check_delta(o, w, True, offset=1))
    ck.run("scatter refusals", lambda: check_refusals(gen))
    ck.run("side stream (gpu and pinned baselines)", lambda: check_side_stream(gen))
    print(f"check: {ck.cases} cases, {len(ck.failures)} failures ({time.perf_counter() - t0:.1f} s)", flush=True)
    return ck


# ------------------------------------------------------------------ timings
def _time(fn, reps: int, before=None) -> float:
    """Median seconds of fn() between CUDA events (before() runs untimed ahead of each rep)."""
    times = []
    for i in range(reps + 2):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 2:  # two warm-ups
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def time_case(mib: int, rate: float, reps: int, gen: torch.Generator, pinned: bool = False) -> dict:
    lib = cuda_kernels.library()
    n = mib * (1 << 20) // 2
    old, new = realistic_pair(n, rate, gen)
    changed = int((bits(old) != bits(new)).sum())
    nbytes = n * 2
    stream = torch.cuda.current_stream().cuda_stream
    dst = torch.empty_like(new)
    copy_s = _time(lambda: dst.copy_(new), reps)
    # torch's elementwise XOR of the same two tensors into a third: reads what the delta pass
    # reads and writes a dense output, a second reference for the pass's bandwidth.
    xor_s = _time(lambda: torch.bitwise_xor(bits(new), bits(old), out=bits(dst)), reps)
    dst = None  # frees it
    base = torch.empty(n, dtype=torch.bfloat16, pin_memory=True) if pinned else torch.empty_like(old)
    c, b = bits(new), bits(base)
    b_ptr = cuda_kernels.device_pointer(b) if pinned else b.data_ptr()
    pos = torch.empty(n, dtype=torch.int32, device="cuda")
    val = torch.empty(n, dtype=torch.int16, device="cuda")
    nv = torch.empty(n, dtype=torch.int16, device="cuda")
    ws_bytes = lib.dcr_cuda_delta_workspace(n)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    res = torch.zeros(2, dtype=torch.int64, device="cuda")

    def launch(newv):
        rc = lib.dcr_cuda_delta(c.data_ptr(), b_ptr, n, 2, pos.data_ptr(), 0, val.data_ptr(), newv, n, ws.data_ptr(),
                                ws_bytes, res.data_ptr(), 0, stream)
        if rc:
            raise RuntimeError(f"dcr_cuda_delta: {rc}")

    restore = lambda: base.copy_(old)  # noqa: E731
    delta_s = _time(lambda: launch(0), reps, restore)
    if int(res[0]) != changed or int(res[1]) != n:
        raise AssertionError(f"delta count {res.tolist()} != {changed} changes of {n}")
    delta_new_s = _time(lambda: launch(nv.data_ptr()), reps, restore)
    row = {"mib": mib, "rate": changed / n, "changed": changed, "baseline": "pinned" if pinned else "gpu",
           "copy_gbps": nbytes / copy_s / 1e9, "xor_gbps": nbytes / xor_s / 1e9, "delta_gbps": nbytes / delta_s / 1e9,
           "delta_new_gbps": nbytes / delta_new_s / 1e9}
    if not pinned:
        target = old.clone()
        sws = torch.empty(16, dtype=torch.uint8, device="cuda")
        p, v = pos[:changed], val[:changed]

        def apply():
            rc = lib.dcr_cuda_scatter(bits(target).data_ptr(), n, 2, p.data_ptr(), 0, v.data_ptr(), changed, 0,
                                      sws.data_ptr(), 16, res.data_ptr(), stream)
            if rc:
                raise RuntimeError(f"dcr_cuda_scatter: {rc}")

        apply_s = _time(apply, reps)
        row["apply_gbps"] = nbytes / apply_s / 1e9
        row["apply_changes_per_s"] = changed / apply_s
        # End to end as the sender runs it: side stream, count read back, pinned output.
        side = cuda_kernels.SideStream()
        for _ in range(2):  # the second: the caching allocators are warm
            base.copy_(old)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            side.take(new, base)
            row["take_pinned_ms"] = 1e3 * (time.perf_counter() - t0)
        del target
    row["delta_vs_copy"] = row["delta_gbps"] / row["copy_gbps"]
    row["delta_new_vs_copy"] = row["delta_new_gbps"] / row["copy_gbps"]
    if "apply_gbps" in row:
        row["apply_vs_copy"] = row["apply_gbps"] / row["copy_gbps"]
    return row


def print_table(rows: list[dict]) -> None:
    print("\nCUDA kernels vs a device-to-device copy of the same bytes (BF16, GB/s of input, medians)")
    print(f"{'MiB':>5} {'base':>6} {'rate':>6} {'copy':>7} {'xor':>7} {'delta':>7} {'%copy':>6} {'+new':>7} "
          f"{'%copy':>6} {'apply':>8} {'%copy':>6} {'take ms':>8}")
    for r in rows:
        apply = f"{'-':>8} {'-':>6}"
        if "apply_gbps" in r:
            apply = f"{r['apply_gbps']:8.0f} {100 * r['apply_vs_copy']:5.0f}%"
        take = f"{r['take_pinned_ms']:8.1f}" if "take_pinned_ms" in r else f"{'-':>8}"
        print(f"{r['mib']:5d} {r['baseline']:>6} {100 * r['rate']:5.2f}% {r['copy_gbps']:7.0f} {r['xor_gbps']:7.0f} "
              f"{r['delta_gbps']:7.0f} "
              f"{100 * r['delta_vs_copy']:5.0f}% {r['delta_new_gbps']:7.0f} {100 * r['delta_new_vs_copy']:5.0f}% "
              f"{apply} {take}")


def default_json() -> Path:
    out = os.environ.get("OUT")
    if out:
        return Path(out) / "cuda.json"
    return RESULTS / "cuda.json"


def run(sizes_mib: list[int], rates: list[float], reps: int = 10, json_path: str | None = None,
        check: bool = True) -> int:
    """Checks, timings, JSON, table last. Returns 0, or 1 when a check failed."""
    if not torch.cuda.is_available():
        print("nemo-dcr bench cuda: error: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if cuda_kernels.library() is None:
        print(f"nemo-dcr bench cuda: error: the CUDA kernels did not load ({cuda_kernels.library_path()}; "
              "build them with `python cuda_ext/build.py --cuda` or `nemo-dcr build-kernels --cuda`)", file=sys.stderr)
        return 2
    defines = cuda_kernels.build_info().get("defines", [])  # a tuning variant's knobs (scripts/cuda_tune.sh)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"library {cuda_kernels.library_path()}{' ' + ' '.join(defines) if defines else ''}", flush=True)
    result: dict = {"device": props.name, "torch": torch.__version__, "library": str(cuda_kernels.library_path()),
                    "targets": TARGETS, "definition": "GB/s of input: n x element size / median kernel time",
                    "defines": defines}
    failures: list[str] = []
    if check:
        ck = run_checks()
        failures = ck.failures
        result["check"] = {"cases": ck.cases, "failures": failures}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for mib in sizes_mib:
        for rate in rates:
            print(f"timing {mib} MiB at {rate:.0%} ...", flush=True)
            rows.append(time_case(mib, rate, reps, gen))
            torch.cuda.empty_cache()
    if sizes_mib and rates:
        mib = min(sizes_mib)
        print(f"timing {mib} MiB at {rates[len(rates) // 2]:.0%} with a pinned host baseline ...", flush=True)
        rows.append(time_case(mib, rates[len(rates) // 2], max(3, reps // 3), gen, pinned=True))
    gpu_rows = [r for r in rows if r["baseline"] == "gpu"]
    result["rows"] = rows
    result["met"] = {
        "delta": bool(gpu_rows) and all(r["delta_vs_copy"] >= TARGETS["delta"] for r in gpu_rows),
        "apply": bool(gpu_rows) and all(r["apply_vs_copy"] >= TARGETS["apply"] for r in gpu_rows),
    }
    write_json(json_path or default_json(), result)
    if failures:
        print(f"CHECK FAILED: {len(failures)} of {result['check']['cases']} cases", flush=True)
    print_table(rows)
    print(f"targets: delta >= {TARGETS['delta']:.0%} of copy: {'met' if result['met']['delta'] else 'NOT met'}; "
          f"apply >= {TARGETS['apply']:.0%}: {'met' if result['met']['apply'] else 'NOT met'}; "
          f"check: {'ok' if check and not failures else ('skipped' if not check else 'FAILED')}")
    return 1 if failures else 0


def summarize(paths: list[str], json_path: str | None = None) -> int:
    """scripts/cuda_tune.sh's last step: one row per variant (its defines, its checks, the delta
    pass and the apply as % of the copy at each rate), written to cuda_tune.json."""
    variants = []
    for path in paths:
        r = json.loads(Path(path).read_text())
        gpu = [x for x in r.get("rows", []) if x["baseline"] == "gpu"]
        variants.append({"defines": r.get("defines", []), "check": r.get("check"), "rows": gpu,
                         "delta_vs_copy_min": min((x["delta_vs_copy"] for x in gpu), default=None),
                         "apply_vs_copy_min": min((x["apply_vs_copy"] for x in gpu), default=None)})
    print("\nCUDA delta kernel variants (GB/s of input as % of the copy; min over the rows)")
    print(f"{'variant':<44} {'checks':>12} {'delta':>7} {'+new':>6} {'apply':>7}")
    for v in variants:
        ck = v["check"] or {}
        checks = f"{ck.get('cases', 0) - len(ck.get('failures', []))}/{ck.get('cases', 0)} ok" if ck else "-"
        new = min((x["delta_new_vs_copy"] for x in v["rows"]), default=float("nan"))
        d, a = v["delta_vs_copy_min"], v["apply_vs_copy_min"]
        print(f"{' '.join(v['defines']) or '(defaults)':<44} {checks:>12} "
              f"{100 * d if d is not None else float('nan'):6.0f}% {100 * new:5.0f}% "
              f"{100 * a if a is not None else float('nan'):6.0f}%")
    out = Path(json_path) if json_path else default_json().with_name("cuda_tune.json")
    write_json(out, {"variants": variants, "targets": TARGETS})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_dcr_callback.bench.cuda", description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", default="256,1024")
    p.add_argument("--rates", default="0.01,0.03,0.05")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="tabulate the results of several runs (variants)")
    a = p.parse_args(argv)
    if a.summarize:
        return summarize(a.summarize, a.json)
    return run([int(x) for x in a.sizes_mib.split(",") if x], [float(x) for x in a.rates.split(",") if x],
               a.reps, a.json, check=not a.skip_check)


if __name__ == "__main__":
    sys.exit(main())
