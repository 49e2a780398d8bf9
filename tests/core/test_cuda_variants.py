"""The delta pass's tuning variants (cuda_ext/cuda/dcr_cuda.cu's -DDCR_* knobs) under the CPU
emulation: each one cuda_tune.sh would time on a device gives the reference's output first."""

from __future__ import annotations

import re

import pytest
import torch

from nemo_dcr_callback.core import cuda_kernels
from tests.helpers import REPO
from tests.helpers.cuda_emu import build, emu_delta
from tests.helpers.tensors import perturb, random_tensor


def _tune_variants() -> list[str]:
    """The variant list scripts/cuda_tune.sh runs by default (its DEFAULT_VARIANTS)."""
    text = (REPO / "scripts" / "cuda_tune.sh").read_text()
    block = text[text.index("DEFAULT_VARIANTS=("):]
    return re.findall(r'"([^"]*)"', block[:block.index(")\n")])


@pytest.fixture(scope="module")
def emu_variant(tmp_path_factory):
    """The emulated library built with a variant's -DDCR_* knobs (one build per variant)."""
    cxx = build.find_cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    libs = {}

    def get(defines: str):
        if defines not in libs:
            out = tmp_path_factory.mktemp("emu-variant") / "libdcr_cuda_emu.so"
            build.compile_to(out, lambda tmp: build.emulation_command(cxx, tmp, build.check_defines(defines)))
            libs[defines] = cuda_kernels.load(out)
        return libs[defines]
    return get


def _check_variant(lib):
    """A variant's delta against the reference: each width, sparse and dense, aligned, partial
    edge vectors and the scalar path, and rounds resumed after capacity runs out."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.float64):
        old = random_tensor((20011,), dtype, g)
        for rate in (0.01, 1.0):
            new = perturb(old, rate, g, specials=True)
            emu_delta(lib, old, new)
            emu_delta(lib, old, new, keep_new=False, offset=3)
            emu_delta(lib, old, new, offset=1, base_offset=0)
        new = perturb(old, 0.4, g)
        emu_delta(lib, old, new, offset=5, cap=1)
        emu_delta(lib, old, new, cap=3000, pos64=True)


@pytest.mark.parametrize("defines", ["-DDCR_REREAD=1", "-DDCR_TWO_PHASE=1", "-DDCR_STAGES=3 -DDCR_BLOCK=256"])
def test_emulated_pass_variants(emu_variant, defines):
    """The L2 reread, the two-phase pass and the cp.async-staged pass (off by default, issue 51's
    candidates) give the reference's output; tests/ with NEMO_DCR_CUDA_DEFINES runs the whole
    suite on one."""
    _check_variant(emu_variant(defines))


@pytest.mark.slow
def test_emulated_every_tune_variant(emu_variant):
    """Every variant cuda_tune.sh times on a device builds and passes here first."""
    variants = _tune_variants()
    assert "" in variants and len(variants) >= 5
    for defines in variants:
        _check_variant(emu_variant(defines))
