#!/usr/bin/env python
"""What ptxas makes of each delta-pass variant, without a GPU (issue 51): registers per thread
and spill bytes of the BF16 fast-path kernels for sm_90 (H100/H200), and from them the resident
threads per SM and the input bytes a full SM has loaded into registers at once (the figure
docs/CUDA.md's "Why, as far as measured" names as the likely limit). Static facts only: which
variant is fastest still needs `scripts/cuda_tune.sh` on a device.
  .venv/bin/python scripts/experiments/cuda_registers.py --json benchmarks/results/cuda_registers.json \
      --variant=-DDCR_MIN_BLOCKS=3 --variant=-DDCR_PERSIST=1 --tune-list
  .venv/bin/python scripts/experiments/cuda_registers.py --variant= --variant=-DDCR_REREAD=1
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "cuda_ext"))
import build  # noqa: E402  (cuda_ext/build.py: the library's own compile line)

# sm_90's register file and limits (CUDA occupancy calculator): 64K 32-bit registers per SM,
# allocated per warp in units of 256, at most 64 warps and 32 blocks per SM; 228 KB of shared
# memory per SM, 1 KB of it reserved per block.
REGS_PER_SM, ALLOC_UNIT, MAX_WARPS, MAX_BLOCKS = 65536, 256, 64, 32
SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED = 228 * 1024, 1024
KERNELS = ("delta_kernel_persist", "delta_kernel_staged", "delta_kernel", "count_kernel", "prefix_kernel",
           "write_kernel")


def tune_variants() -> list[str]:
    text = (REPO / "scripts" / "cuda_tune.sh").read_text()
    block = text[text.index("DEFAULT_VARIANTS=("):]
    return re.findall(r'"([^"]*)"', block[:block.index(")\n")])


def knob(defines: str, name: str, default: int) -> int:
    m = re.search(rf"-D{name}=(\d+)", defines)
    return int(m.group(1)) if m else default


def resident_blocks(regs: int, block: int, smem: int = 0) -> int:
    per_warp = -(-regs * 32 // ALLOC_UNIT) * ALLOC_UNIT
    warps = min(REGS_PER_SM // per_warp, MAX_WARPS)
    blocks = min(warps // (block // 32), MAX_BLOCKS)
    return min(blocks, SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)) if smem else blocks


def ptxas(nvcc: str, defines: str) -> dict[str, dict]:
    """{kernel: {registers, spill_stores}} of the BF16 (unsigned short), int32-position, widest
    vector instance of each delta kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [c for c in build.nvcc_command(nvcc, build.CUDA_SOURCE, Path(tmp) / "x.so", defines.split())
               if not c.startswith("arch=")]
        cmd = [c for c in cmd if c != "-gencode"] + ["-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v"]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"nvcc failed for [{defines}]:\n{out.stderr[-2000:]}")
    found: dict[str, dict] = {}
    name, spill = None, 0
    for line in out.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores", line):
            spill = int(m.group(1))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            k = re.search(r"\d+(" + "|".join(KERNELS) + r")ItiLi(\d+)E", name)
            if k and int(k.group(2)) > 2:  # the vector path, not the scalar one (VB = 2)
                found[k.group(1)] = {"registers": int(m.group(1)), "spill_stores": spill}
            name = None
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", dest="variants",
                    help="a -DDCR_* set, written --variant=-DDCR_... (empty: the defaults); repeatable. "
                         "Default: cuda_tune.sh's default list")
    ap.add_argument("--tune-list", action="store_true", help="cuda_tune.sh's default list too, after --variant's")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("cuda_registers: no nvcc on PATH", file=sys.stderr)
        return 2
    variants = (args.variants or []) + (tune_variants() if args.tune_list or not args.variants else [])
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    rows = []
    print(f"{'variant':52} {'kernel':22} {'regs':>5} {'spill B':>8} {'threads/SM':>11} {'KB of tiles/SM':>14}")
    for v in variants:
        block, vecs, vb = knob(v, "DCR_BLOCK", 512), knob(v, "DCR_VECS", 4), knob(v, "DCR_VEC_BYTES", 16)
        tile = block * vecs * vb * 2  # cur and base of one tile
        for kernel, r in ptxas(nvcc, v).items():
            stages = knob(v, "DCR_STAGES", 0) if kernel == "delta_kernel_staged" else 1  # tiles a block holds
            smem = tile * stages if kernel == "delta_kernel_staged" else 0
            blocks = resident_blocks(r["registers"], block, smem)
            loaded = blocks * tile * stages if kernel != "prefix_kernel" else 0
            rows.append({"defines": v, "kernel": kernel, **r, "block": block, "dynamic_smem": smem,
                         "resident_threads": blocks * block, "tile_bytes_per_sm": loaded})
            threads = blocks * block
            print(f"{v or '(defaults)':52} {kernel:22} {r['registers']:>5} {r['spill_stores']:>8} {threads:>11} "
                  f"{loaded / 1024:>14.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"what": "ptxas -v, BF16 fast path, sm_90", "nvcc": version,
                                               "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
