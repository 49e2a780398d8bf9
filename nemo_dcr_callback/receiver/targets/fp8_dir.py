"""Fp8DirTarget: a block-FP8 checkpoint directory (DeepSeek-V3's layout) kept bit-exact with
the BF16 policy by sparse requantization.

The trainer sends BF16 deltas. FP8 bytes cannot be derived from FP8 bytes and a BF16 delta
(a block's scale depends on its largest BF16 value, and a changed value's old BF16 bits are
gone once cast), so the directory keeps a BF16 shadow of its quantized weights in
`.nemo-dcr/shadow.safetensors`, memory-mapped: 2 bytes per quantized parameter on disk, only
the touched pages in memory. A version's changes land in the shadow; every 128x128 block
with at least one change is requantized (core/fp8.py, the serving engine's arithmetic) and
its new FP8 bytes and scale are written in place. The redo log holds all of it (shadow bits,
FP8 bytes, scales) before any file changes, as for CheckpointDirTarget, so a crash mid-apply
is completed on the next open and a refused version changes nothing. Why not FP8-block
deltas from the sender: TP/PP shards do not align with 128x128 blocks of the canonical
weights, and the figures are in docs/FP8.md.

`convert()` makes such a directory from a BF16 checkpoint (`nemo-dcr fp8-init`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.core import fp8
from nemo_dcr_callback.receiver.targets.checkpoint_dir import CheckpointDirTarget

SHADOW = "shadow.safetensors"
META = "fp8.json"
RAW = "#fp8"  # suffix naming a quantized weight's FP8 bytes (the bare name is its BF16 shadow)
SCALE = "_scale_inv"  # DeepSeek-V3's name for a weight's block scales: "<name>_scale_inv"
# The linear weights an FP8 checkpoint quantizes (DeepSeek-V3, Qwen3 FP8): attention and MLP
# projections, experts included; embeddings, lm_head, norms and routers stay as they are.
QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj"
                       r"|kv_a_proj_with_mqa|kv_b_proj|w1|w2|w3)\.weight$")


def is_quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.dtype == torch.bfloat16 and QUANTIZED.search(name) is not None


def convert(src, out, recipe: str = "vllm", version: int = 0) -> dict:
    """Write the block-FP8 checkpoint of BF16 checkpoint `src` into directory `out` (with the
    BF16 shadow of its quantized weights, at `version`). Returns {quantized, params}."""
    from safetensors.torch import save_file

    from nemo_dcr_callback.tools.checkpoint import Checkpoint

    if recipe not in fp8.RECIPES:
        raise ValueError(f"FP8 recipe must be one of {', '.join(fp8.RECIPES)}, not {recipe!r}")
    ck = Checkpoint(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    (out / ".nemo-dcr").mkdir(parents=True, exist_ok=True)
    model, shadow = {}, {}
    for name in sorted(ck.where):
        t = ck.tensor(name).contiguous()
        if is_quantized(name, t):
            q, s = fp8.quantize(t, recipe)
            model[name], model[name + SCALE], shadow[name] = q, s, t
        else:
            model[name] = t
    save_file(model, str(out / "model.safetensors"))
    save_file(shadow, str(out / ".nemo-dcr" / SHADOW))
    if ck.is_dir:
        for other in ck.other_files:
            shutil.copyfile(ck.path / other, out / other)
        cfg_p = out / "config.json"
        if cfg_p.exists():  # the layout serving engines read (DeepSeek-V3's quantization_config)
            cfg = json.loads(cfg_p.read_text())
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
            cfg_p.write_text(json.dumps(cfg, indent=2))
    (out / ".nemo-dcr" / META).write_text(json.dumps({"recipe": recipe, "quantized": sorted(shadow)}))
    (out / ".nemo-dcr" / "state.json").write_text(json.dumps({"version": version, "pending": None,
                                                               "pending_version": None}))
    return {"quantized": len(shadow), "params": sum(t.numel() for t in shadow.values())}


class Fp8DirTarget(CheckpointDirTarget):
    """Canonical names are the BF16 checkpoint's: a quantized weight reads as its BF16 shadow
    (so chunks are checked and digests computed on BF16 bits, as everywhere else)."""

    def __init__(self, path):
        self._shadow = None
        super().__init__(path)  # (a pending redo log is replayed there, through _loc)
        self._open_shadow()

    def _open_shadow(self) -> None:
        if self._shadow is not None:
            return
        import mmap

        from nemo_dcr_callback.tools.checkpoint import SafetensorsFile

        meta = json.loads((self.meta / META).read_text())
        self.recipe = meta["recipe"]
        self._shadow = SafetensorsFile(self.meta / SHADOW)
        self.quantized = set(meta["quantized"])
        if set(self._shadow.entries) != self.quantized:
            raise codec.ChunkError(f"{self.meta / SHADOW} does not hold the quantized weights {META} names")
        f = open(self._shadow.path, "r+b")
        self._maps[SHADOW] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE))

    def _loc(self, name: str):
        self._open_shadow()
        if name.endswith(RAW):
            return super()._loc(name[:-len(RAW)])
        if name in self.quantized:
            f, mm = self._maps[SHADOW]
            return self._shadow, self._shadow.entries[name], f, mm
        return super()._loc(name)

    def names(self) -> list[str]:
        return [n for n in self.where if not (n.endswith(SCALE) and n[:-len(SCALE)] in self.quantized)]

    def check(self, h: codec.ChunkHeader) -> None:
        if h.name not in self.names():
            raise codec.ChunkError(f"checkpoint has no tensor {h.name!r} (wrong model?)")
        codec.check_target(h, self.tensor(h.name), h.name)

    def raw(self, name: str) -> torch.Tensor:
        """A quantized weight's FP8 bytes, as float8_e4m3fn [m, n]."""
        return self.tensor(name + RAW)

    def scales(self, name: str) -> torch.Tensor:
        return self.tensor(name + SCALE)

    # ------------------------------------------------------------ applying
    def _records(self, decoded: list[codec.DecodedChunk]) -> list:
        records = super()._records(decoded)
        return records + [r for name, pos, new in records if name in self.quantized
                          for r in self._requantized(name, pos, new)]

    def _requantized(self, name: str, pos: torch.Tensor, new: torch.Tensor) -> list:
        """The FP8 bytes and scales that change when the shadow's bits at pos become new: every
        touched block requantized from the shadow with the changes in (records: byte
        positions of the FP8 weight, block positions of its scales; only what differs)."""
        m, n = self._loc(name)[1].shape
        w = self.tensor(name).view(m, n)
        gm, gn = fp8.grid((m, n))
        p = pos.long()
        rows, cols = p // n, p % n
        blk = (rows // fp8.BLOCK) * gn + cols // fp8.BLOCK
        ids = torch.unique(blk)  # sorted
        blocks = fp8.gather_blocks(w, ids)
        k = torch.searchsorted(ids, blk)
        blocks[k, rows % fp8.BLOCK, cols % fp8.BLOCK] = new.view(torch.bfloat16)
        q, sf = fp8.quantize_blocks(blocks, self.recipe)
        # the blocks' element positions in the [m, n] weight (edge blocks cut to it)
        br, bc = (ids // gn) * fp8.BLOCK, (ids % gn) * fp8.BLOCK
        ar = torch.arange(fp8.BLOCK)
        r = br[:, None, None] + ar[None, :, None]
        c = bc[:, None, None] + ar[None, None, :]
        inside = (r < m) & (c < n)
        flat_pos = (r * n + c)[inside]
        qbytes = q.view(torch.uint8)[inside]
        order = torch.argsort(flat_pos)
        flat_pos, qbytes = flat_pos[order], qbytes[order]
        old = self.raw(name).view(torch.uint8).reshape(-1)[flat_pos]
        diff = qbytes != old
        out = [(name + RAW, flat_pos[diff].contiguous(), qbytes[diff].contiguous())]
        old_sf = self.scales(name).reshape(-1)[ids]
        sdiff = sf.view(torch.int32) != old_sf.view(torch.int32)
        out.append((name + SCALE, ids[sdiff].contiguous(), sf[sdiff].contiguous()))
        return out

    def apply_with_terms(self, decoded, version=None):
        terms = super().apply_with_terms(decoded, version)
        return {n: t for n, t in terms.items() if not n.endswith((RAW, SCALE))}
