"""The CUDA kernels' build module and their emulation on the CPU, shared by the kernel tests
(tests/core/test_cuda_ext.py, test_cuda_variants.py, test_build.py)."""

from __future__ import annotations

import torch

from nemo_dcr_callback.core import cuda_kernels, delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.tools import doctor
from tests.helpers import REPO


def load_build_module():
    """A fresh copy of cuda_ext/build.py, the one place the compile lines live, loaded as
    `nemo-dcr build-kernels` loads it (tests may patch their copy)."""
    return doctor._build_module(REPO / "cuda_ext" / "build.py")


build = load_build_module()


def emu_delta(lib, old, new, keep_new=True, *, offset=0, base_offset=None, **kw):
    """take_with on host tensors placed at the given element offsets; checked against the reference."""
    n = old.numel()
    base_offset = offset if base_offset is None else base_offset
    cur = torch.empty(n + offset, dtype=new.dtype)[offset:]
    cur.copy_(new.reshape(-1))
    base = torch.empty(n + base_offset, dtype=old.dtype)[base_offset:]
    base.copy_(old.reshape(-1))
    ref_base = old.reshape(-1).clone()
    ref = delta.take_delta_reference(new.reshape(-1), ref_base, keep_new=keep_new)
    got = cuda_kernels.take_with(lib, cur, base, keep_new, "device", **kw)
    if kw.get("pos64"):
        assert got.positions.dtype == torch.int64
        assert torch.equal(got.positions, ref.positions.to(torch.int64))
    else:
        assert got.positions.dtype == ref.positions.dtype and torch.equal(got.positions, ref.positions)
    assert torch.equal(got.xor, ref.xor)
    assert (got.new is None) if not keep_new else torch.equal(got.new, ref.new)
    assert torch.equal(bits(base), bits(ref_base)), "baseline after the pass"
    assert torch.equal(bits(cur), bits(new.reshape(-1))), "current must stay untouched"
    return got, base
