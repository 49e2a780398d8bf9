"""Placement: fixed affine maps from a rank's local shard positions to canonical positions.

Built once per model from `sharded_state_dict()` (global shape and offset of every local
shard, the stacked layer axis, replica ids, the SwiGLU factory) and a family table. Each
local parameter gets a list of segments; a segment is a run of whole local rows that lands
on consecutive rows of one canonical tensor:

    canonical = canon_offset + (i // row_len) * canon_stride + (i % row_len)
    for local flat index local_start <= i + local_start < local_start + length

(row_len == canon_stride, the common case, is a plain shift). `project` applies them to
sorted sparse positions with a few vectorised numpy operations per segment; no per-element
Python. Only the main replica of a shard sends it, and data-parallel ranks split each
parameter's flat range evenly, so every canonical element is sent by exactly one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.placement.families import Family, MapKind, Rule


@dataclass
class ParamMap:
    """One local parameter: which slice this rank sends and where its rows land."""

    name: str  # Megatron parameter name (module path)
    key: str  # sharded key
    param: torch.Tensor
    rule: Rule
    layer: int | None
    lo: int  # this rank sends local flat positions [lo, hi) of the parameter
    hi: int
    residual: bool  # canonical bits are not a copy of the training bits
    # Segment table (parallel arrays, ascending local_start; canon_id indexes `canon`).
    local_start: np.ndarray
    length: np.ndarray
    row_len: np.ndarray
    canon_id: np.ndarray
    canon_offset: np.ndarray
    canon_stride: np.ndarray
    canon: list[str]
    dtype: torch.dtype = torch.bfloat16  # the parameter's (training) dtype
    canon_dtype: torch.dtype = torch.bfloat16  # the canonical tensors' dtype
    size: int = 0  # the parameter's number of elements
    # project()'s search bounds by (add, positions' dtype): made once, not every version
    bounds: dict = field(default_factory=dict, repr=False, compare=False)
    _table: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return self.size

    def segment_table(self) -> np.ndarray:
        """The segments as one int64 array of rows (local_start, length, row_len, canon_id,
        canon_offset, canon_stride): the compiled slice encoder's input (made once)."""
        if self._table is None:
            self._table = np.ascontiguousarray(np.stack(
                [self.local_start, self.length, self.row_len, self.canon_id, self.canon_offset, self.canon_stride],
                axis=1).astype(np.int64).reshape(-1, 6))
        return self._table


@dataclass
class Projected:
    name: str  # canonical tensor
    positions: np.ndarray  # canonical flat positions, ascending
    parts: list[tuple[int, int]]  # slices [a, b) of the input positions, in output order


class Placement:
    """All ParamMaps of this rank plus the canonical tensors' shapes."""

    def __init__(self, params: list[ParamMap], canonical: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.params = params
        self.canonical = canonical  # name -> shape (only those this rank touches)
        self.dtype = dtype
        self._numels: dict[str, np.ndarray] = {}

    def numel(self, name: str) -> int:
        return math.prod(self.canonical[name])

    def numels(self, pm: ParamMap) -> np.ndarray:
        """The element counts of pm's canonical tensors (int64, in pm.canon's order; made once)."""
        got = self._numels.get(pm.name)
        if got is None:
            got = self._numels[pm.name] = np.array([self.numel(n) for n in pm.canon], dtype=np.int64)
        return got

    @staticmethod
    def project(pm: ParamMap, positions: np.ndarray, add: int = 0) -> list[Projected]:
        """Sorted local flat positions (positions + add; int32 or int64) -> canonical positions
        per tensor (sorted, int64), with the slices of the input that went to each (so values
        follow with the same slices). The compiled map runs when the library is there."""
        lib = kernels.native()
        out: dict[int, Projected] = {}
        # the bounds in the positions' own dtype (clipped to its range, which keeps every
        # answer): with int64 bounds numpy would convert all int32 positions first, twice
        key = (add, positions.dtype)
        lo_b, hi_b = pm.bounds.get(key) or pm.bounds.setdefault(key, (
            _as(pm.local_start - add, positions.dtype), _as(pm.local_start + pm.length - add, positions.dtype)))
        a_idx = np.searchsorted(positions, lo_b)
        b_idx = np.searchsorted(positions, hi_b)
        native = lib is not None and positions.dtype in (np.int32, np.int64)
        if native:
            positions = np.ascontiguousarray(positions)
            pos64, base, width = int(positions.dtype == np.int64), positions.ctypes.data, positions.itemsize
        for s in range(pm.local_start.size):
            a, b = int(a_idx[s]), int(b_idx[s])
            if a == b:
                continue
            rl, st = int(pm.row_len[s]), int(pm.canon_stride[s])
            if native:
                c = np.empty(b - a, dtype=np.int64)
                lib.dcr_affine(base + a * width, pos64, b - a, add, int(pm.local_start[s]), rl, st,
                               int(pm.canon_offset[s]), c.ctypes.data)
            else:
                p = positions[a:b].astype(np.int64) + (add - pm.local_start[s])
                c = p + pm.canon_offset[s] if rl == st else (p // rl) * st + (p % rl) + pm.canon_offset[s]
            cid = int(pm.canon_id[s])
            if cid not in out:
                out[cid] = Projected(pm.canon[cid], [], [])  # type: ignore[arg-type]
            out[cid].positions.append(c)  # type: ignore[attr-defined]
            out[cid].parts.append((a, b))
        res = []
        for pr in out.values():
            pr.positions = np.concatenate(pr.positions) if len(pr.positions) > 1 else pr.positions[0]
            res.append(pr)
        return res


def _as(bounds: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Search bounds in the dtype of the positions searched (no conversion of the positions)."""
    if dtype.kind != "i" or bounds.dtype == dtype:
        return bounds
    lim = np.iinfo(dtype)
    return np.clip(bounds, lim.min, lim.max).astype(dtype)


def _rows(rule: Rule, R: np.ndarray, g_rows: int, dims: dict) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Megatron global rows -> (canonical tensor index or -1, canonical row), plus the
    canonical row counts of the rule's tensors."""
    kind = rule.kind
    if kind == MapKind.PLAIN:
        return np.zeros_like(R), R, [g_rows]
    if kind == MapKind.VOCAB:
        v = dims["vocab_size"]
        return np.where(R < v, 0, -1), R, [v]
    if kind == MapKind.QKV:
        hd, nq, ng = dims["head_dim"], dims["heads"], dims["groups"]
        hpg = nq // ng
        rpg = (hpg + 2) * hd
        g, w = R // rpg, R % rpg
        qn = hpg * hd
        tid = np.where(w < qn, 0, np.where(w < qn + hd, 1, 2))
        row = np.where(tid == 0, g * qn + w, np.where(tid == 1, g * hd + w - qn, g * hd + w - qn - hd))
        return tid, row, [nq * hd, ng * hd, ng * hd]
    if kind == MapKind.GATED:
        f = g_rows // 2
        tid = (R >= f).astype(np.int64)
        return tid, R - tid * f, [f, f]
    raise ValueError(f"no row map for {kind}")


def _segments(tid: np.ndarray, crow: np.ndarray, local_cols: int, canon_cols: int, col_off: int, base: int):
    """Runs of consecutive local rows with the same canonical tensor and consecutive rows
    (local positions start at element `base` of the parameter)."""
    n = tid.size
    if n == 0:
        return []
    brk = np.ones(n, dtype=bool)
    brk[1:] = (tid[1:] != tid[:-1]) | (crow[1:] != crow[:-1] + 1)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], n)
    segs = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if tid[s] < 0:
            continue
        nrows = e - s
        if local_cols == canon_cols:  # whole rows: one linear run
            segs.append((base + s * local_cols, nrows * local_cols, nrows * local_cols, int(tid[s]),
                         int(crow[s]) * canon_cols, nrows * local_cols))
        else:
            segs.append((base + s * local_cols, nrows * local_cols, local_cols, int(tid[s]),
                         int(crow[s]) * canon_cols + col_off, canon_cols))
    return segs


def _is_main(replica_id) -> bool:
    """Main replica ignoring the data-parallel component (the last one): DP ranks split."""
    rid = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(int(x) == 0 for x in rid[:-1]) if len(rid) > 1 else True


def _expert_dp() -> tuple[int, int]:
    """This rank's expert-data-parallel rank and size (megatron-core's parallel state)."""
    from megatron.core import parallel_state as ps  # start-up cost: megatron.core takes ~2 s to import

    return ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()


def build_placement(model, family: Family, vocab_size: int, *, dtype: torch.dtype = torch.bfloat16,
                    dp_rank: int = 0, dp_size: int = 1, edp_rank: int | None = None,
                    edp_size: int | None = None) -> Placement:
    """Maps for every parameter (and persistent buffer with a sharded entry, e.g. a router's
    expert bias) of this rank's model chunk (a megatron-core GPTModel, or a DDP / Float16Module
    wrapper around one). Expert parameters are split over the expert-data-parallel ranks
    (edp_*: default, megatron-core's parallel state), the others over dp_*."""
    # start-up cost: megatron.core takes ~2 s to import, only for a live Megatron model
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    cfg = inner.config
    dims = {"vocab_size": vocab_size, "heads": cfg.num_attention_heads,
            "groups": cfg.num_query_groups or cfg.num_attention_heads,
            "head_dim": cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads}
    params = dict(inner.named_parameters())
    buffers = {n: b for n, b in inner.named_buffers() if b.numel() and b.dtype.is_floating_point}
    by_ptr = {(p.data_ptr(), p.numel()): n for n, p in (buffers | params).items()}
    tensors = buffers | params
    maps: list[ParamMap] = []
    canonical: dict[str, tuple[int, ...]] = {}
    seen: set[str] = set()
    for sh in inner.sharded_state_dict().values():
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            continue
        pname = by_ptr.get((sh.data.data_ptr(), sh.data.numel()))
        if pname is None:
            continue
        seen.add(pname)
        p = tensors[pname]
        rule, key_layer = family.lookup(sh.key)
        if rule.tied_skip and getattr(inner, "share_embeddings_and_output_weights", False):
            continue
        # A factory (SwiGLU fc1: local [gate_r; up_r]) builds the ShardedTensors of its pieces.
        pieces = sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]
        pieces = list(pieces.values()) if isinstance(pieces, dict) else list(pieces)
        segs, layer, expert, rows_per, g_cols, main = [], key_layer, None, [], 1, True
        for piece in pieces:
            base = (piece.data.data_ptr() - p.data_ptr()) // p.element_size()
            pre = piece.prepend_axis_num
            # prepended axes: [layer (stacked keys)] then [expert (expert rules)]
            if rule.expert:
                expert = int(piece.global_offset[pre - 1])
            if key_layer is None and pre > int(rule.expert):
                layer = int(piece.global_offset[0])
            g_shape = tuple(piece.global_shape[pre:])
            g_off = tuple(piece.global_offset[pre:])
            if len(g_shape) == 1:
                g_shape, g_off = (g_shape[0], 1), (g_off[0], 0)
            local_cols = piece.data.shape[-1] if piece.data.dim() == 2 else 1
            R = g_off[0] + np.arange(piece.data.numel() // local_cols)
            tid, crow, rows_per = _rows(rule, R, g_shape[0], dims)
            g_cols = g_shape[1]
            segs += _segments(tid, crow, local_cols, g_cols, g_off[1], base)
            main = main and _is_main(piece.replica_id)
        names = [h.format(layer=layer, expert=expert) for h in rule.hf]
        for nm, rows in zip(names, rows_per, strict=True):
            canonical[nm] = (rows, g_cols) if p.dim() == 2 else (rows,)
        segs.sort()
        n = p.numel()
        if rule.expert and edp_size is None:
            edp_rank, edp_size = _expert_dp()
        r, size = (edp_rank, edp_size) if rule.expert else (dp_rank, dp_size)
        lo, hi = (n * r // size, n * (r + 1) // size) if main else (0, 0)
        canon_dtype = getattr(torch, rule.dtype) if rule.dtype else dtype
        arr = np.array(segs, dtype=np.int64).reshape(-1, 6)
        maps.append(ParamMap(
            name=pname, key=sh.key, param=p, rule=rule, layer=layer, lo=lo, hi=hi,
            residual=p.dtype != canon_dtype or rule.transform is not None, canon_dtype=canon_dtype,
            local_start=arr[:, 0].copy(), length=arr[:, 1].copy(), row_len=arr[:, 2].copy(),
            canon_id=arr[:, 3].copy(), canon_offset=arr[:, 4].copy(), canon_stride=arr[:, 5].copy(),
            canon=names, dtype=p.dtype, size=n))
    missing = set(params) - seen
    if missing:
        raise ValueError(f"parameters without a sharded-state-dict entry: {sorted(missing)}")
    return Placement(maps, canonical, dtype)
