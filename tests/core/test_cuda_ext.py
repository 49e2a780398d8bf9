"""The CUDA kernels (cuda_ext/cuda/dcr_cuda.cu), with and without a GPU.

Without a GPU (CI): nvcc compiles the .cu with the production line; the same source built by
g++ against cuda_emu.h runs the kernels' logic on CPU fibers through the same Python rounds
(cuda_kernels.take_with / scatter_with), checked against the CPU reference; plus dispatch,
build line (cuda_ext/build.py), loading, CLI and the baseline option. With a GPU: the real
kernels against the reference (scripts/device_check.sh runs them and more).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_dcr_callback.core import bitops, cuda_kernels, delta, kernels
from nemo_dcr_callback.core.rawbits import bits
from tests.helpers import REPO
from tests.helpers.cuda_emu import build, emu_delta, load_build_module
from tests.helpers.tensors import FLOAT_DTYPES, perturb, random_tensor

GPU = torch.cuda.is_available()
DTYPES = FLOAT_DTYPES + [torch.int8, torch.float64]




# ------------------------------------------------------------------ nvcc compile check
@pytest.fixture(scope="module")
def nvcc_build(tmp_path_factory):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    out_dir = tmp_path_factory.mktemp("cuda")
    t0 = time.perf_counter()
    entry = build.build_cuda(out_dir, defines=build.env_defines())
    return out_dir / entry["library"], time.perf_counter() - t0


def test_nvcc_compiles_the_kernels(nvcc_build):
    path, seconds = nvcc_build
    assert path.stat().st_size > 0
    print(f"nvcc build: {seconds:.1f} s")
    # Loading and the host-side entry points need no GPU (the CUDA runtime is linked statically).
    lib = cuda_kernels.load(path)
    assert lib.dcr_cuda_abi_version() == cuda_kernels.ABI_VERSION
    if not build.env_defines():  # the default tile: 512 threads x 4 vectors x 8 BF16
        assert lib.dcr_cuda_delta_min_cap(2) == 512 * 4 * 8
    assert lib.dcr_cuda_delta_min_cap(3) == -9
    assert lib.dcr_cuda_delta_workspace(0) >= 16
    min_tile = lib.dcr_cuda_delta_min_cap(1) // 16  # the scalar path's tile: threads x vectors
    assert lib.dcr_cuda_delta_workspace(10**6) >= 16 + 8 * (10**6 // min_tile)


def test_nvcc_library_refuses_bad_arguments_before_any_launch(nvcc_build):
    lib = cuda_kernels.load(nvcc_build[0])
    a = 4096  # an aligned address that is never dereferenced: every call below refuses first
    assert lib.dcr_cuda_delta(a, a, 10, 3, a, 0, a, None, 10, a, 1000, a, 0, None) == -9  # width
    assert lib.dcr_cuda_delta(a + 1, a, 10, 2, a, 0, a, None, 10, a, 1000, a, 0, None) == -7  # alignment
    assert lib.dcr_cuda_delta(a, a, 100000, 2, a, 0, a, None, 10, a, 10**6, a, 0, None) == -8  # capacity
    assert lib.dcr_cuda_delta(a, a, 100000, 2, a, 0, a, None, 100000, a, 10, a, 0, None) == -8  # workspace
    assert lib.dcr_cuda_scatter(a, 10, 2, a, 0, a, 1, 3, a, 16, a, None) == -9  # op
    assert lib.dcr_cuda_scatter(a, 10, 1, a, 0, a, 1, 2, a, 16, a, None) == -9  # ulp on bytes
    assert lib.dcr_cuda_scatter(a, 10, 2, a, 0, a, 1, 0, a, 8, a, None) == -8  # workspace
    assert lib.dcr_cuda_strerror(-8) == b"workspace or output capacity too small"
    if not GPU:  # a launch without a driver reports a CUDA error, with its text
        rc = lib.dcr_cuda_delta(a, a, 0, 2, a, 0, a, None, 0, a, 100, a, 0, None)
        assert rc <= -1000 and lib.dcr_cuda_strerror(rc)


def test_build_line():
    cmd = build.nvcc_command("nvcc", Path("x.cu"), Path("x.so"))
    line = " ".join(cmd)
    for flag in ("-O3", "-shared", "-Xcompiler -fPIC", "-cudart static",
                 "-gencode arch=compute_90,code=sm_90", "-gencode arch=compute_90,code=compute_90",
                 "-gencode arch=compute_80,code=sm_80"):
        assert flag in line
    assert cmd[-3:] == ["x.cu", "-o", "x.so"]


def test_library_path_is_the_package_copy_or_the_env(tmp_path, monkeypatch):
    """Run time loads the library inside the package (or $NEMO_DCR_CUDA_LIB), never cuda_ext/."""
    monkeypatch.delenv("NEMO_DCR_CUDA_LIB", raising=False)
    assert cuda_kernels.library_path() == kernels.LIB_DIR / "libdcr_cuda.so"
    assert kernels.LIB_DIR == Path(cuda_kernels.__file__).resolve().parents[1] / "_lib"
    monkeypatch.setenv("NEMO_DCR_CUDA_LIB", str(tmp_path / "variant" / "libdcr_cuda.so"))
    assert cuda_kernels.library_path() == tmp_path / "variant" / "libdcr_cuda.so"
    (tmp_path / "variant").mkdir()
    build.write_build_info(tmp_path / "variant", cuda={"defines": ["-DDCR_BLOCK=128"]})
    assert cuda_kernels.build_info()["defines"] == ["-DDCR_BLOCK=128"]  # what bench cuda records


def test_env_library_is_the_one_loaded(tmp_path, monkeypatch):
    """NEMO_DCR_CUDA_LIB is honoured by library() itself (a fresh process: the load is once)."""
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from nemo_dcr_callback.core import cuda_kernels as c\n"
            "assert c.library() is None and c.library() is None\n")
    env = {**os.environ, "NEMO_DCR_CUDA_LIB": str(tmp_path / "missing.so")}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert str(tmp_path / "missing.so") in p.stderr and "$NEMO_DCR_CUDA_LIB" in p.stderr
    assert p.stderr.count("CUDA kernels are unavailable") == 1 and "build-kernels --cuda" in p.stderr


def test_build_without_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.BuildError, match="nvcc not found"):
        build.build_cuda(tmp_path)
    assert not (tmp_path / "libdcr_cuda.so").exists()


# ------------------------------------------------------------------ the kernels on CPU fibers
@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """dcr_cuda.cu built with g++ against cuda_emu.h: the real kernel code, run on the CPU."""
    cxx = build.find_cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("emu") / "libdcr_cuda_emu.so"
    # $NEMO_DCR_CUDA_DEFINES reaches this build too, so each tuning variant's logic can be checked.
    build.compile_to(out, lambda tmp: build.emulation_command(cxx, tmp, build.env_defines()))
    return cuda_kernels.load(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 31, 2049, 8193, 20011])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.3, 1.0])
def test_emulated_delta_equals_reference(emu, dtype, n, rate):
    g = torch.Generator().manual_seed(n * 7 + int(rate * 100))
    old = random_tensor((n,), dtype, g)
    new = perturb(old, rate, g, specials=True)
    emu_delta(emu, old, new)  # 16-byte vectors from an aligned start
    emu_delta(emu, old, new, keep_new=False, offset=3)  # same phase, partial first and last vectors
    emu_delta(emu, old, new, offset=1, base_offset=0)  # phases differ: the scalar path


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_delta_resumes_when_capacity_runs_out(emu, dtype):
    """Outputs smaller than the delta: tiles that do not fit leave the baseline alone and the
    Python rounds resume there; positions come out offset and in order all the same."""
    g = torch.Generator().manual_seed(11)
    old = random_tensor((70001,), dtype, g)
    new = perturb(old, 1.0, g)
    emu_delta(emu, old, new, offset=5, cap=1)
    new = perturb(old, 0.4, g)
    emu_delta(emu, old, new, cap=9000, pos64=True)
    emu_delta(emu, old, new, cap=1, scalar=True)


def test_emulated_realistic_bf16_and_undo(emu):
    g = torch.Generator().manual_seed(5)
    master = torch.randn(50_000, generator=g) * 0.02
    old = master.to(torch.bfloat16)
    new = (master + 1e-6 * torch.randn(50_000, generator=g)).to(torch.bfloat16)  # about 3% change
    rate = (bits(old) != bits(new)).float().mean().item()
    assert 0.01 < rate < 0.06
    d, base = emu_delta(emu, old, new, offset=2)
    cuda_kernels.scatter_with(emu, base, d.positions, d.xor, bitops.OP_XOR)  # the undo log
    assert torch.equal(bits(base), bits(old))


def _ulp_values(d: bitops.SparseDelta, old: torch.Tensor) -> torch.Tensor:
    if d.xor.element_size() == 8:  # the torch ulp reference covers widths 2 and 4
        out = torch.empty_like(d.xor)
        assert kernels.native().dcr_ulp_encode(d.xor.data_ptr(), d.new.data_ptr(), d.count, 8, out.data_ptr()) == 0
        return out
    return bitops.ulp_diff_reference(bits(old).reshape(-1)[d.positions.long()], d.new)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [bitops.OP_XOR, bitops.OP_OVERWRITE, bitops.OP_ULP])
@pytest.mark.parametrize("pos64", [False, True])
def test_emulated_scatter_equals_reference(emu, dtype, op, pos64):
    g = torch.Generator().manual_seed(op * 10 + int(pos64))
    old = random_tensor((9001,), dtype, g)
    new = perturb(old, 0.3, g, specials=True)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    pos = d.positions.to(torch.int64) if pos64 else d.positions
    target = old.clone()
    if op == bitops.OP_ULP and dtype.itemsize == 1:
        with pytest.raises(ValueError, match="does not apply"):
            cuda_kernels.scatter_with(emu, target, pos, d.xor, op)
        assert torch.equal(bits(target), bits(old))
        return
    vals = {bitops.OP_XOR: d.xor, bitops.OP_OVERWRITE: d.new}.get(op)
    vals = _ulp_values(d, old) if vals is None else vals
    want = old.clone()
    bitops.scatter(want, pos, vals, op)  # the compiled CPU kernel
    cuda_kernels.scatter_with(emu, target, pos, vals, op)
    assert torch.equal(bits(target), bits(want))
    assert torch.equal(bits(target), bits(new))


@pytest.mark.parametrize("positions", [[5, 3], [4, 4], [-1, 2], [10, 100]])
@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_emulated_scatter_refuses_and_writes_nothing(emu, positions, idx):
    t = torch.arange(100, dtype=torch.float32)
    before = t.clone()
    with pytest.raises(ValueError, match="refused"):
        cuda_kernels.scatter_with(emu, t, torch.tensor(positions, dtype=idx), torch.ones(2), bitops.OP_XOR)
    assert torch.equal(bits(t), bits(before))
    cuda_kernels.scatter_with(emu, t, torch.empty(0, dtype=idx), torch.empty(0), bitops.OP_XOR)
    assert torch.equal(bits(t), bits(before))


# ------------------------------------------------------------------ dispatch and options (no GPU needed)
def test_cpu_tensors_never_reach_the_cuda_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CPU tensors went to the CUDA path")

    monkeypatch.setattr(cuda_kernels, "take_delta_cuda", boom)
    monkeypatch.setattr(cuda_kernels, "scatter_cuda", boom)
    monkeypatch.setattr(cuda_kernels, "library", boom)
    g = torch.Generator().manual_seed(1)
    old = random_tensor((4099,), torch.bfloat16, g)
    new = perturb(old, 0.05, g)
    base = old.clone()
    d = delta.take_delta(new, base, keep_new=True)
    ref = delta.take_delta_reference(new, old.clone(), keep_new=True)
    assert torch.equal(d.positions, ref.positions) and torch.equal(d.xor, ref.xor)
    delta.undo(base, d)
    assert torch.equal(bits(base), bits(old))


@pytest.mark.skipif(GPU, reason="checks the CPU-only behaviour")
def test_no_cuda_means_no_library_loaded(monkeypatch):
    monkeypatch.setattr(cuda_kernels, "load", lambda *a, **k: pytest.fail("must not load without CUDA"))
    assert cuda_kernels.library() is None and not cuda_kernels.available()
    with pytest.raises(RuntimeError, match="unavailable"):
        cuda_kernels._require()


def test_cuda_entry_points_refuse_host_tensors():
    t = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA shard"):
        cuda_kernels.take_delta_cuda(t, t.clone())
    with pytest.raises(ValueError, match="CUDA target"):
        cuda_kernels.scatter_cuda(t, torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match="out must be"):
        cuda_kernels.take_delta_cuda(t, t.clone(), out="disk")
    with pytest.raises(ValueError, match="for the baselines of CUDA shards"):
        cuda_kernels.place_baseline(t, "pinned")


@pytest.mark.parametrize("bad", ["cpu", "GPU", "", "host"])
def test_baseline_option_is_validated(bad):
    from nemo_dcr_callback import DCRCallback
    from nemo_dcr_callback.testing.tensor_sender import TensorSender

    with pytest.raises(ValueError, match="baseline must be one of gpu, pinned"):
        DCRCallback(baseline=bad)
    with pytest.raises(ValueError, match="baseline must be one of"):
        TensorSender({"w": torch.zeros(4)}, baseline=bad)
    assert DCRCallback(baseline="pinned").cfg.baseline == "pinned"
    assert DCRCallback().cfg.baseline == "gpu"


def test_baseline_option_leaves_cpu_senders_alone():
    """CPU tensors: the option changes nothing (plain host baselines, the CPU kernel)."""
    from nemo_dcr_callback.testing.tensor_sender import TensorSender

    g = torch.Generator().manual_seed(2)
    w = random_tensor((1000,), torch.bfloat16, g)
    old = w.clone()
    s = TensorSender({"w": w}, baseline="pinned")
    assert not s.baselines["w"].is_cuda
    w.copy_(perturb(w, 0.1, g))
    (_, d), = s.take()
    ref = delta.take_delta_reference(w, old.clone(), keep_new=True)
    assert d.positions.device.type == "cpu" and torch.equal(d.positions, ref.positions)
    assert torch.equal(bits(s.baselines["w"]), bits(w))


def test_build_kernels_cuda_without_nvcc(monkeypatch, capsys, tmp_path):
    """`nemo-dcr build-kernels --cuda` (tools.doctor.run_build) in a checkout without nvcc: exit 2, said why."""
    from nemo_dcr_callback.tools import doctor

    p = argparse.ArgumentParser()
    doctor.add_build_arguments(p)
    assert p.parse_args(["--cuda"]).cuda and not p.parse_args([]).cuda
    mod = load_build_module()
    monkeypatch.setattr(mod, "find_nvcc", lambda: None)
    monkeypatch.setattr(mod, "build_cpu", lambda out_dir, **kw: {"library": "libdcr_cpu.so"})
    monkeypatch.setattr(doctor, "_build_module", lambda path: mod)
    assert doctor.run_build(p.parse_args(["--cuda", "--out", str(tmp_path)])) == 2
    assert "nvcc not found" in capsys.readouterr().err
    assert doctor.run_build(p.parse_args(["--defines", "DCR_BLOCK=128", "--out", str(tmp_path)])) == 2
    assert "add --cuda" in capsys.readouterr().err


@pytest.mark.skipif(GPU, reason="checks the CPU-only behaviour")
def test_cli_bench_cuda_without_a_gpu(capsys):
    from nemo_dcr_callback import cli

    assert cli.main(["bench", "cuda", "--sizes-mib", "1", "--rates", "0.01"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_device_check_script_parses():
    script = REPO / "scripts" / "device_check.sh"
    assert script.stat().st_mode & 0o111, "device_check.sh must be executable"
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_device_check_runs_every_gpu_test_case():
    """Issue 67: the suite's GPU cases skip here and pointed at device_check.sh, which never
    ran pytest. Every test file with a case that needs a CUDA device is in its GPU_TESTS."""
    text = (REPO / "scripts" / "device_check.sh").read_text()
    listed = text.split("GPU_TESTS=(")[1].split(")")[0]
    needing = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
               if "needs a CUDA device" in p.read_text()}
    assert needing and all(f in listed for f in needing), (sorted(needing), listed)


# ------------------------------------------------------------------ on a GPU
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device (scripts/device_check.sh)")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 31, 8193, 1_000_003])
@pytest.mark.parametrize("rate", [0.0, 0.03, 1.0])
def test_gpu_delta_equals_reference(dtype, n, rate):
    from nemo_dcr_callback.bench import cuda as bench_cuda

    gen = torch.Generator(device="cuda").manual_seed(n + int(rate * 100))
    old, new = bench_cuda.random_pair(n, dtype, rate, gen)
    bench_cuda.check_delta(old, new, True)
    bench_cuda.check_delta(old, new, False, offset=3)
    bench_cuda.check_delta(old, new, True, offset=1, base_offset=0)
    bench_cuda.check_delta(old, new, True, cap=1, baseline="pinned", out="pinned")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [0, 1, 2])
def test_gpu_scatter_equals_reference(dtype, op):
    from nemo_dcr_callback.bench import cuda as bench_cuda

    if op == 2 and dtype.itemsize == 1:
        pytest.skip("no ulp op on bytes")
    gen = torch.Generator(device="cuda").manual_seed(op)
    bench_cuda.check_scatter(100_003, dtype, op, 0.05, gen)
    bench_cuda.check_scatter(100_003, dtype, op, 0.5, gen, pos64=True, host_inputs=True)


@gpu
def test_gpu_refusals_and_side_stream():
    from nemo_dcr_callback.bench import cuda as bench_cuda

    gen = torch.Generator(device="cuda").manual_seed(3)
    bench_cuda.check_refusals(gen)
    bench_cuda.check_side_stream(gen)


@gpu
@pytest.mark.parametrize("baseline", ["gpu", "pinned"])
def test_gpu_tensor_sender_matches_cpu(baseline):
    """TensorSender on CUDA tensors: pinned host deltas, the same as on CPU copies."""
    from nemo_dcr_callback.testing.tensor_sender import TensorSender

    g = torch.Generator().manual_seed(4)
    w = random_tensor((100_003,), torch.bfloat16, g)
    new = perturb(w, 0.03, g)
    s_gpu = TensorSender({"w": w.cuda()}, baseline=baseline)
    s_cpu = TensorSender({"w": w.clone()})
    s_gpu.tensors["w"].copy_(new)
    s_cpu.tensors["w"].copy_(new)
    (_, dg), = s_gpu.take()
    (_, dc), = s_cpu.take()
    assert dg.positions.is_pinned() and torch.equal(dg.positions, dc.positions)
    assert torch.equal(dg.xor, dc.xor) and torch.equal(dg.new, dc.new)
    s_gpu.roll_back([("w", dg)])
    assert torch.equal(bits(s_gpu.baselines["w"]).cpu(), bits(w))


# ------------------------------------------------------------------ tuning variants (no GPU needed)
def test_tuning_defines_reach_the_nvcc_command(monkeypatch, tmp_path):
    """-DDCR_* knobs (--defines, else NEMO_DCR_CUDA_DEFINES) reach the nvcc line; nothing else is taken."""
    monkeypatch.delenv("NEMO_DCR_CUDA_DEFINES", raising=False)
    assert build.env_defines() == []
    monkeypatch.setenv("NEMO_DCR_CUDA_DEFINES", "-DDCR_BLOCK=256 -DDCR_FENCE=2")
    assert build.env_defines() == ["-DDCR_BLOCK=256", "-DDCR_FENCE=2"]
    assert build.check_defines("DCR_BLOCK=256 -DDCR_FENCE=2") == ["-DDCR_BLOCK=256", "-DDCR_FENCE=2"]
    cmd = build.nvcc_command("nvcc", build.CUDA_SOURCE, Path("x.so"), build.env_defines())
    assert "-DDCR_BLOCK=256" in cmd and "-DDCR_FENCE=2" in cmd and cmd[-3:] == [str(build.CUDA_SOURCE), "-o", "x.so"]
    seen = []
    monkeypatch.setattr(build, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(build, "compile_to", lambda out, command, verbose=False: seen.append(command(out)) or out)
    monkeypatch.setattr(build, "_version", lambda tool: "")
    assert build.main(["--cuda", "--no-cpu", "-q", "--defines", "-DDCR_BLOCK=128", "--out", str(tmp_path)]) == 0
    assert seen[0][0] == "/opt/nvcc" and "-DDCR_BLOCK=128" in seen[0] and "-DDCR_BLOCK=256" not in seen[0]
    assert build.write_build_info(tmp_path) and (tmp_path / "BUILD.json").read_text().count("DCR_BLOCK=128") == 1
    monkeypatch.setenv("NEMO_DCR_CUDA_DEFINES", "-O0 -DDCR_BLOCK=256")
    with pytest.raises(build.BuildError, match="-DDCR_"):
        build.env_defines()
    assert build.main(["--cuda", "--no-cpu", "--defines", "-O0", "--out", str(tmp_path)]) == 2


def test_tune_summary_table(tmp_path, capsys):
    """scripts/cuda_tune.sh's last step: one row per variant, checks and % of the copy."""
    import json

    from nemo_dcr_callback.bench import cuda as bench_cuda

    row = {"mib": 1024, "rate": 0.03, "changed": 1, "baseline": "gpu", "copy_gbps": 2000.0, "xor_gbps": 1400.0,
           "delta_gbps": 900.0, "delta_new_gbps": 850.0, "apply_gbps": 2000.0, "delta_vs_copy": 0.45,
           "delta_new_vs_copy": 0.425, "apply_vs_copy": 1.0}
    paths = []
    for i, (defs, fails) in enumerate([([], []), (["-DDCR_BLOCK=128"], ["delta bf16 n=7: differs"])]):
        (tmp_path / f"{i}.json").write_text(json.dumps({"defines": defs, "rows": [row],
                                                        "check": {"cases": 811, "failures": fails}}))
        paths.append(str(tmp_path / f"{i}.json"))
    assert bench_cuda.main(["--summarize", *paths, "--json", str(tmp_path / "tune.json")]) == 0
    out = capsys.readouterr().out
    assert "(defaults)" in out and "811/811 ok" in out and "810/811 ok" in out and "45%" in out
    got = json.loads((tmp_path / "tune.json").read_text())
    assert [v["defines"] for v in got["variants"]] == [[], ["-DDCR_BLOCK=128"]]
    assert got["variants"][0]["delta_vs_copy_min"] == pytest.approx(0.45)
