"""Build hooks: the native kernels, compiled into nemo_dcr_callback/_lib/ when the package is built.

pyproject.toml holds the metadata; this file only declares the two libraries and how they are
compiled (cuda_ext/build.py, shared with `nemo-dcr build-kernels`). docs/BUILD.md explains.

Neither library is a Python extension module: both have a plain C ABI loaded through ctypes
(no libpython, no torch headers), so their names carry no Python ABI tag and the wheel is
tagged py3-none-<platform>. Both are optional: without g++ the install succeeds with a warning
(and the package says so again at first use); without nvcc the CUDA library is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB_PACKAGE = "nemo_dcr_callback._lib"


def _load_build_module():
    spec = importlib.util.spec_from_file_location("nemo_dcr_cuda_ext_build", ROOT / "cuda_ext" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


native = _load_build_module()
CPU_EXT = f"{LIB_PACKAGE}.libdcr_cpu"
CUDA_EXT = f"{LIB_PACKAGE}.libdcr_cuda"


def _warn(lines: list[str]) -> None:
    bar = "=" * 78
    print("\n".join(["", bar, *lines, bar, ""]), file=sys.stderr, flush=True)


class BuildNative(build_ext):
    """Compiles the libraries with cuda_ext/build.py's command lines instead of the Python
    extension toolchain, and records what it did in _lib/BUILD.json."""

    def get_ext_filename(self, fullname: str) -> str:
        if fullname in (CPU_EXT, CUDA_EXT):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def run(self) -> None:
        self._entries: dict = {}
        if self.inplace:  # copy_extensions_to_source expects the folder to exist; _lib/ holds no sources
            ROOT.joinpath(*LIB_PACKAGE.split(".")).mkdir(parents=True, exist_ok=True)
        super().run()  # builds into build_lib; in place (editable installs) it copies them to the source tree
        out_dirs = [Path(self.build_lib, *LIB_PACKAGE.split("."))]
        if self.inplace:
            out_dirs.append(ROOT.joinpath(*LIB_PACKAGE.split(".")))
        for d in out_dirs:
            for key, ext in (("cpu", CPU_EXT), ("cuda", CUDA_EXT)):
                # A library not built now must not ship from an older build (build_py copies _lib/ data).
                if self._entries.get(key) is None:
                    (d / Path(self.get_ext_filename(ext)).name).unlink(missing_ok=True)
            native.write_build_info(d, cpu=self._entries.get("cpu"), cuda=self._entries.get("cuda"))

    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent
        if ext.name == CPU_EXT:
            self._entries["cpu"] = self._build_cpu(out_dir)
        elif ext.name == CUDA_EXT:
            self._entries["cuda"] = self._build_cuda(out_dir)
        else:
            super().build_extension(ext)

    def _build_cpu(self, out_dir: Path) -> dict | None:
        flags, origin = native.cpu_flags()
        print(f"nemo-dcr: building the CPU kernels ({' '.join(flags)}, from {origin})", file=sys.stderr, flush=True)
        try:
            return native.build_cpu(out_dir, flags=flags) | {"flags_from": origin}
        except native.BuildError as exc:
            _warn(["WARNING: nemo-dcr: the compiled CPU kernels were NOT built.",
                   f"  Why: {exc}".replace("\n", "\n    "),
                   "  The package installs and works, but every delta, encode and apply then runs on",
                   "  the pure-torch reference, which is much slower.",
                   "  Fix: install g++ (or set CXX) and reinstall the package, or run",
                   "  `nemo-dcr build-kernels` in a source checkout. `nemo-dcr doctor` shows the state."])
            return None

    def _build_cuda(self, out_dir: Path) -> dict | None:
        if os.environ.get("NEMO_DCR_CUDA", "1") == "0":
            print("nemo-dcr: NEMO_DCR_CUDA=0: the CUDA kernels are not built", file=sys.stderr)
            return None
        if native.find_nvcc() is None:
            print("nemo-dcr: nvcc not found: the CUDA kernels are not built (only CUDA shards need them)",
                  file=sys.stderr)
            return None
        print("nemo-dcr: building the CUDA kernels (nvcc)", file=sys.stderr, flush=True)
        try:
            return native.build_cuda(out_dir, defines=native.env_defines())
        except native.BuildError as exc:
            _warn(["WARNING: nemo-dcr: nvcc is here but the CUDA kernels did NOT build.",
                   f"  Why: {exc}".replace("\n", "\n    "),
                   "  CPU shards are unaffected; CUDA shards need this library.",
                   "  Fix: check the nvcc install (or set NEMO_DCR_CUDA=0 to skip it) and reinstall."])
            return None


class Wheel(bdist_wheel):
    """py3-none-<platform>: the libraries work with any Python 3, only the platform matters."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


def _ext(name: str, source: str, **kw) -> Extension:
    return Extension(name, sources=[source], language="c++", optional=True, **kw)


setup(
    ext_modules=[
        _ext(CPU_EXT, "cuda_ext/cpu/dcr_cpu.cpp", extra_compile_args=["-std=c++17", "-O3", "-pthread"],
             extra_link_args=["-pthread"],
             depends=["cuda_ext/build.py", *sorted(str(p) for p in Path("cuda_ext/cpu/parts").glob("*.h"))]),
        _ext(CUDA_EXT, "cuda_ext/cuda/dcr_cuda.cu", depends=["cuda_ext/cuda/cuda_emu.h", "cuda_ext/build.py"]),
    ],
    cmdclass={"build_ext": BuildNative, "bdist_wheel": Wheel},
)
