"""The native kernels as the package ships them: compiled at build time (cuda_ext/build.py via
setup.py) into nemo_dcr_callback/_lib/, loaded from there only, reported by `nemo-dcr doctor`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.tools import doctor
from tests.helpers import REPO
from tests.helpers.cuda_emu import load_build_module

build = load_build_module()


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """A fresh interpreter: the library is loaded once per process."""
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def test_the_package_library_is_current():
    """The loaded library is _lib/libdcr_cpu.so, built from today's source (else: make kernels)."""
    if os.environ.get("NEMO_DCR_CPU_LIB"):
        pytest.skip("NEMO_DCR_CPU_LIB overrides the package library")
    assert kernels.library_path() == kernels.LIB_DIR / "libdcr_cpu.so"
    info = kernels.build_info()["cpu"]
    assert info["source_sha256"] == build.cpu_source_sha256(), \
        "the CPU library is older than its source: run `make kernels`"
    assert info["flags"] and info["compiler"]


def test_missing_library_says_so_once_and_falls_back(tmp_path):
    p = _python("from nemo_dcr_callback.core import kernels\n"
                "assert kernels.native() is None and kernels.native() is None\n"
                "from nemo_dcr_callback.tools import doctor\nprint(doctor.version_text())\n",
                NEMO_DCR_CPU_LIB=str(tmp_path / "nope.so"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("(CPU kernels: torch fallback)")
    assert p.stderr.count("compiled CPU kernels are unavailable") == 1
    for part in (str(tmp_path / "nope.so"), "much slower", "g++", "nemo-dcr build-kernels", "NEMO_DCR_CPU_LIB"):
        assert part in p.stderr


def test_env_library_is_loaded(tmp_path):
    lib = tmp_path / "elsewhere" / "libdcr_cpu.so"
    lib.parent.mkdir()
    shutil.copy(kernels.library_path(), lib)
    p = _python("from nemo_dcr_callback.core import kernels\nlib = kernels.native()\n"
                "print(lib._name, kernels.library_path())\n", NEMO_DCR_CPU_LIB=str(lib))
    assert p.returncode == 0 and not p.stderr, p.stderr
    assert p.stdout.split() == [str(lib), str(lib)]


def test_native_off_is_the_torch_reference(monkeypatch):
    monkeypatch.setenv("NEMO_DCR_NATIVE", "0")
    assert doctor.active_path() == doctor.TORCH_FALLBACK
    assert doctor.version_text().endswith("(CPU kernels: torch fallback)")


def test_simd_path_follows_the_dispatch_switches(monkeypatch):
    """dcr_simd_path reads NEMO_DCR_NO_AVX512 / NEMO_DCR_NO_AVX2 at each call, as the dispatch does."""
    monkeypatch.delenv("NEMO_DCR_NO_AVX512", raising=False)
    monkeypatch.delenv("NEMO_DCR_NO_AVX2", raising=False)
    best = doctor.active_path()
    assert best in ("AVX-512", "AVX2", "portable")
    monkeypatch.setenv("NEMO_DCR_NO_AVX512", "1")
    assert doctor.active_path() == ("AVX2" if best != "portable" else "portable")
    monkeypatch.setenv("NEMO_DCR_NO_AVX2", "1")
    assert doctor.active_path() == "portable"


def test_report_render_and_json(capsys):
    rep = doctor.report()
    assert rep["cpu"]["loaded"] and rep["active_path"] != doctor.TORCH_FALLBACK
    assert rep["version"] and rep["torch"] and isinstance(rep["gpu"], bool)
    assert rep["source_checkout"] == str(REPO)
    text = doctor.render(rep)
    assert "CPU kernels:" in text and f"active path: {rep['active_path']}" in text and "CUDA kernels:" in text
    p = argparse.ArgumentParser()
    doctor.add_doctor_arguments(p)
    assert doctor.run_doctor(p.parse_args(["--json"])) == 0
    assert json.loads(capsys.readouterr().out)["cpu"]["library"] == rep["cpu"]["library"]


def test_build_kernels_from_an_installed_wheel(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "build_script", lambda: None)
    p = argparse.ArgumentParser()
    doctor.add_build_arguments(p)
    assert doctor.run_build(p.parse_args([])) == 0
    out = capsys.readouterr().out
    assert "compiled when it was built" in out and "active path:" in out


def test_cpu_flags():
    assert build.cpu_flags({}) == (["-O3", "-march=native"], "native")
    assert build.cpu_flags({"NEMO_DCR_PORTABLE": "1"}) == (["-O3"], "portable")
    assert build.cpu_flags({"NEMO_DCR_PORTABLE": "1", "NEMO_DCR_CXXFLAGS": "-O2 -mavx2"}) == \
        (["-O2", "-mavx2"], "NEMO_DCR_CXXFLAGS")
    cmd = build.cpu_command("g++", ["-O3"], Path("out.so"))
    assert cmd[:2] == ["g++", "-O3"] and "-std=c++17" in cmd and "-pthread" in cmd and cmd[-2:] == ["-o", "out.so"]


def test_failed_compile_is_an_error_and_leaves_the_old_library(tmp_path):
    out = tmp_path / "libdcr_cpu.so"
    out.write_text("old")
    script = "echo 'dcr_cpu.cpp:1: error: broken' >&2; exit 1"
    with pytest.raises(build.BuildError, match="(?s)exit 1.*broken"):
        build.compile_to(out, lambda tmp: ["sh", "-c", script, "x.cpp", "-o", str(tmp)])
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["libdcr_cpu.so"]


def test_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_cxx", lambda: None)
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build_cpu(tmp_path)
