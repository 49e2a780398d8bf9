"""Checks an installed, non-editable nemo-dcr wheel (`make wheel-smoke` runs it from outside the
source tree, in a fresh venv). Not a pytest module: it needs that install, not the checkout.

    python tests/smoke/wheel_smoke.py REPO   # REPO: the checkout, for tests/golden only
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def check(cond: bool, what: str, detail: object = "") -> None:
    if not cond:
        sys.exit(f"wheel smoke: FAILED: {what}{f' ({detail})' if detail != '' else ''}")
    print(f"  ok  {what}")


def run(cli: Path, *args: object) -> subprocess.CompletedProcess:
    p = subprocess.run([str(cli), *map(str, args)], capture_output=True, text=True)
    check(p.returncode == 0, f"nemo-dcr {args[0]} exits 0", p.stderr[-2000:])
    check("unavailable" not in p.stderr, f"nemo-dcr {args[0]} runs the compiled kernels", p.stderr[-2000:])
    return p


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    repo = Path(argv[1]).resolve()
    golden = repo / "tests" / "golden"
    import nemo_dcr_callback
    from nemo_dcr_callback.tools import doctor

    pkg = Path(nemo_dcr_callback.__file__).resolve().parent
    print(f"wheel smoke: {pkg}")
    check("site-packages" in pkg.parts and pkg != repo / "nemo_dcr_callback", "the package imports from site-packages",
          pkg)
    check(doctor.build_script() is None, "no source checkout beside it")
    wheel = importlib.metadata.distribution("nemo-dcr-callback").read_text("WHEEL") or ""
    check("Tag: py3-none-" in wheel and "Root-Is-Purelib: false" in wheel, "the wheel is py3-none-<platform>", wheel)

    rep = doctor.report()
    print("\n".join("      " + ln for ln in doctor.render(rep).splitlines()))
    cpu = rep["cpu"]
    lib = pkg / "_lib" / "libdcr_cpu.so"
    check(cpu["loaded"] and Path(cpu["library"]) == lib, "the CPU library loads from the package", cpu)
    check(rep["active_path"] in ("AVX-512", "AVX2", "portable"), "the active path is compiled code", rep["active_path"])
    want = "portable" if os.environ.get("NEMO_DCR_PORTABLE", "0") not in ("", "0") else None
    check(want is None or cpu["build"].get("flags_from") == want, "BUILD.json records the build's flags", cpu["build"])
    if rep["cuda"]["present"]:
        check(rep["cuda"]["loaded"], "the CUDA library shipped in the wheel loads", rep["cuda"])
    check(doctor.version_text().endswith(f"(CPU kernels: {rep['active_path']})"), "version_text names the path")

    from nemo_dcr_callback.recipes import train

    configs = Path(train.CONFIGS)
    check(configs.parent == pkg and (configs / "dcr.yaml").is_file() and (configs / "train_gpt.yaml").is_file(),
          "the configs ship in the package", configs)
    json.dumps(rep)

    cli = Path(sys.executable).parent / "nemo-dcr"
    with tempfile.TemporaryDirectory() as tmp:
        delta = Path(tmp) / "delta_v3.dcr"
        run(cli, "diff", golden / "old", golden / "new", "-o", delta, "-q")
        check(delta.read_bytes() == (golden / "delta_v3.dcr").read_bytes(), "diff writes the golden delta's bytes")
        out = Path(tmp) / "out"
        run(cli, "patch", golden / "old", golden / "delta_v3.dcr", "-o", out)
        names = sorted(p.name for p in (golden / "new").iterdir())
        check(sorted(p.name for p in out.iterdir()) == names, "patch writes new/'s files", names)
        for name in names:
            check((out / name).read_bytes() == (golden / "new" / name).read_bytes(), f"patched {name} is new/'s bytes")
    print(f"wheel smoke: passed in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
