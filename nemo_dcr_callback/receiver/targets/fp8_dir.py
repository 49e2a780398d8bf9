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
import mmap
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec.checkpoint import Checkpoint, SafetensorsFile
from nemo_dcr_callback.core import fp8
from nemo_dcr_callback.receiver.targets.checkpoint_dir import CheckpointDirTarget

SHADOW = "shadow.safetensors"
AMAX = "amax.safetensors"
AMAX_OF = "#amax"  # suffix naming a quantized weight's block maxima (in AMAX)
DENSE_FROM = 8  # requantize a weight whole once more than 1/DENSE_FROM of its blocks are touched
META = "fp8.json"
RAW = "#fp8"  # suffix naming a quantized weight's FP8 bytes (the bare name is its BF16 shadow)
SCALE = "_scale_inv"  # DeepSeek-V3's name for a weight's block scales: "<name>_scale_inv"
# The linear weights an FP8 checkpoint quantizes (DeepSeek-V3, Qwen3 FP8): attention and MLP
# projections, experts included; embeddings, lm_head, norms and routers stay as they are.
QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj"
                       r"|kv_a_proj_with_mqa|kv_b_proj|w1|w2|w3)\.weight$")


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """Each block's largest |w| (fp32 [gm, gn], before the cast's clamp): kept beside the
    shadow, so that a version that leaves a block's maximum alone requantizes only its changed
    values (the scale is the same, and the cast is elementwise given the scale)."""
    m, n = w.shape
    gm, gn = fp8.grid((m, n))
    padded = torch.zeros((gm * fp8.BLOCK, gn * fp8.BLOCK), dtype=w.dtype)
    padded[:m, :n] = w
    return padded.view(gm, fp8.BLOCK, gn, fp8.BLOCK).abs().float().amax(dim=(1, 3)).contiguous()


def is_quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.dtype == torch.bfloat16 and QUANTIZED.search(name) is not None


def convert(src, out, recipe: str = "vllm", version: int = 0) -> dict:
    """Write the block-FP8 checkpoint of BF16 checkpoint `src` into directory `out` (with the
    BF16 shadow of its quantized weights, at `version`). Returns {quantized, params}."""
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
    save_file({n: block_amax(t) for n, t in shadow.items()}, str(out / ".nemo-dcr" / AMAX))
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
        meta = json.loads((self.meta / META).read_text())
        self.recipe = meta["recipe"]
        self._shadow = SafetensorsFile(self.meta / SHADOW)
        self.quantized = set(meta["quantized"])
        if set(self._shadow.entries) != self.quantized:
            raise codec.ChunkError(f"{self.meta / SHADOW} does not hold the quantized weights {META} names")
        f = open(self._shadow.path, "r+b")
        self._maps[SHADOW] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE))
        self._amax = SafetensorsFile(self.meta / AMAX)
        f = open(self._amax.path, "r+b")
        self._maps[AMAX] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE))

    def _loc(self, name: str):
        self._open_shadow()
        if name.endswith(RAW):
            return super()._loc(name[:-len(RAW)])
        if name.endswith(AMAX_OF):
            f, mm = self._maps[AMAX]
            return self._amax, self._amax.entries[name[:-len(AMAX_OF)]], f, mm
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
        # One requantization per weight, from all of its chunks at once: a weight comes in
        # several chunks (one per tensor-parallel rank, or per chunk span), and a block's
        # scale depends on every value in it. Requantized chunk by chunk, each saw the other
        # chunks' values as they were, and the last written won (the soak found it: seed 1).
        changes: dict[str, list] = {}
        for name, pos, new in records:
            if name in self.quantized:
                changes.setdefault(name, []).append((pos, new))
        out = list(records)
        for name, parts in changes.items():
            pos, new = torch.cat([p for p, _ in parts]), torch.cat([v for _, v in parts])
            if len(parts) > 1:
                order = torch.argsort(pos)
                pos, new = pos[order], new[order]
            out += self._requantized(name, pos, new)
        return out

    def _requantized(self, name: str, pos: torch.Tensor, new: torch.Tensor) -> list:
        """The FP8 bytes, scales and block maxima that change when the shadow's bits at pos
        become new (records, only of what differs). A touched block whose maximum |w| stays
        (most of them: an optimizer step rarely moves a block's largest value) keeps its scale,
        and its changed values are cast alone; a block whose maximum moves, or may have (its
        largest value changed, or NaN is involved), is requantized whole from the shadow."""
        m, n = self._loc(name)[1].shape
        w = self.tensor(name).view(m, n)
        gm, gn = fp8.grid((m, n))
        p = pos.long()
        rows, cols = p // n, p % n
        blk = (rows // fp8.BLOCK) * gn + cols // fp8.BLOCK
        ids, inv = torch.unique(blk, return_inverse=True)  # touched blocks, sorted
        old_q = self.raw(name).view(torch.uint8).reshape(-1)
        old_sf = self.scales(name).reshape(-1)
        amax = self.tensor(name + AMAX_OF).reshape(-1)
        new_v = new.view(torch.bfloat16)
        old_a, new_a = w.reshape(-1)[p].abs().float(), new_v.abs().float()
        top = amax[ids]
        cand = top.clone().scatter_reduce_(0, inv, new_a, "amax")  # (NaN propagates)
        whole = torch.zeros(len(ids), dtype=torch.bool)
        whole[inv[(old_a >= top[inv]) | torch.isnan(old_a) | torch.isnan(new_a)]] = True
        whole |= torch.isnan(top) | (cand.view(torch.int32) != top.view(torch.int32))
        q_at, q_new, s_at, s_new, a_at, a_new = [], [], [], [], [], []
        # blocks that keep their scale: the changed values cast alone, as the block cast does
        keep = ~whole[inv]
        if keep.any():
            kp, kb = p[keep], blk[keep]
            if self.recipe == "deepgemm-v1":
                factor = fp8.FP8_MAX / amax[kb].clamp(1e-4)
            else:
                factor = 1.0 / old_sf[kb]
            qb = (new_v[keep] * factor).to(torch.float8_e4m3fn).view(torch.uint8)
            d = qb != old_q[kp]
            q_at.append(kp[d])
            q_new.append(qb[d])
        redo = ids[whole]
        if len(redo) * DENSE_FROM > gm * gn:  # many blocks: the whole weight at once
            cur = w.clone()
            cur.view(-1)[p] = new_v
            q, sf = fp8.quantize(cur, self.recipe)
            qb, sf, am = q.view(torch.uint8).reshape(-1), sf.reshape(-1), block_amax(cur).reshape(-1)
            in_redo = torch.zeros(gm * gn, dtype=torch.bool)
            in_redo[redo] = True
            sel = (in_redo.view(gm, gn).repeat_interleave(fp8.BLOCK, 0)
                   .repeat_interleave(fp8.BLOCK, 1)[:m, :n].reshape(-1))
            at = torch.nonzero(sel & (qb != old_q)).reshape(-1)
            q_at.append(at)
            q_new.append(qb[at])
            s_at.append(redo), s_new.append(sf[redo]), a_at.append(redo), a_new.append(am[redo])
        elif len(redo):
            blocks = fp8.gather_blocks(w, redo)
            sel = whole[inv]
            k = torch.searchsorted(redo, blk[sel])
            blocks[k, rows[sel] % fp8.BLOCK, cols[sel] % fp8.BLOCK] = new_v[sel]
            q, sf = fp8.quantize_blocks(blocks, self.recipe)
            br, bc = (redo // gn) * fp8.BLOCK, (redo % gn) * fp8.BLOCK
            ar = torch.arange(fp8.BLOCK)
            r = br[:, None, None] + ar[None, :, None]
            c = bc[:, None, None] + ar[None, None, :]
            inside = (r < m) & (c < n)
            fpos, qb = (r * n + c)[inside], q.view(torch.uint8)[inside]
            d = qb != old_q[fpos]
            q_at.append(fpos[d])
            q_new.append(qb[d])
            s_at.append(redo), s_new.append(sf), a_at.append(redo)
            a_new.append(blocks.abs().float().amax(dim=(1, 2)))
        return [self._record(name + RAW, q_at, q_new, torch.uint8),
                self._record(name + SCALE, s_at, s_new, torch.float32, old_sf),
                self._record(name + AMAX_OF, a_at, a_new, torch.float32, amax)]

    @staticmethod
    def _record(name: str, at: list, vals: list, dtype, old: torch.Tensor | None = None):
        """One overwrite record from pieces: positions sorted, and (for scales and maxima)
        only where the bits differ from `old`."""
        if not at:
            return name, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype)
        pos, val = torch.cat(at), torch.cat(vals)
        if old is not None:
            d = val.view(torch.int32) != old[pos].view(torch.int32)
            pos, val = pos[d], val[d]
        order = torch.argsort(pos)
        return name, pos[order].contiguous(), val[order].contiguous()

    def apply_with_terms(self, decoded, version=None):
        terms = super().apply_with_terms(decoded, version)
        return {n: t for n, t in terms.items() if not n.endswith((RAW, SCALE, AMAX_OF))}
