"""The dense export: the oracle that tests and verify mode compare the delta path with.

Gathers every rank's shards to one rank, assembles Megatron's global tensors from the
sharded-state-dict metadata and converts them to a Hugging Face state dict with the usual
converter arithmetic (reshape the QKV rows per query group and split them, chunk fc1 into
gate and up, drop vocabulary padding, cast to the checkpoint dtype). It deliberately does
not use the segment maps of maps.py, so a wrong map cannot hide behind a wrong oracle; an
fp32 forward comparison (tests) checks the conversion itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_dcr_callback.placement.families import Family, MapKind


def _pieces(model) -> list[tuple[str, tuple, tuple, int, torch.Tensor]]:
    # start-up cost: megatron.core takes ~2 s to import, only for a live Megatron model
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    out = []
    for sh in inner.sharded_state_dict().values():
        if isinstance(sh, ShardedTensorFactory):
            built = sh.build()
            items = list(built.values()) if isinstance(built, dict) else list(built)
        elif isinstance(sh, ShardedTensor):
            items = [sh]
        else:
            continue
        for it in items:
            if any(int(x) for x in (it.replica_id if isinstance(it.replica_id, tuple) else (it.replica_id,))):
                continue  # every replica holds the same bits; the main one is enough
            out.append((it.key, tuple(it.global_shape), tuple(it.global_offset), it.prepend_axis_num,
                        it.data.detach().clone()))
    return out


def gather_megatron(model, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Megatron's global tensors (keyed by sharded key, layer axis first) on rank dst."""
    mine = _pieces(model)
    world = dist.get_world_size()
    got = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(mine, got, dst=dst)
    if dist.get_rank() != dst:
        return None
    full: dict[str, torch.Tensor] = {}
    for pieces in got:
        for key, gshape, goff, pre, data in pieces:
            if key not in full:
                full[key] = torch.zeros(gshape, dtype=data.dtype)
            idx = tuple(slice(o, o + n) for o, n in zip(goff, (1,) * pre + tuple(data.shape), strict=True))
            full[key][idx] = data.reshape(tuple((1,) * pre) + tuple(data.shape))
    return full


def to_hf(full: dict[str, torch.Tensor], family: Family, cfg, vocab_size: int, tied: bool,
          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Megatron global tensors -> Hugging Face state dict (the converter's arithmetic)."""
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    hd = cfg.kv_channels or cfg.hidden_size // heads
    hpg = heads // groups
    out: dict[str, torch.Tensor] = {}
    for key, t in full.items():
        rule, key_layer = family.lookup(key)
        if rule.tied_skip and tied:
            continue
        stacked = key_layer is None and key.startswith("decoder.layers.")  # a leading layer axis
        for layer, expert, w in _slices(t, stacked, rule.expert, key_layer):
            names = [h.format(layer=layer, expert=expert) for h in rule.hf]
            if rule.kind == MapKind.PLAIN:
                parts = [w]
            elif rule.kind == MapKind.VOCAB:
                parts = [w[:vocab_size]]
            elif rule.kind == MapKind.QKV:
                g = w.reshape(groups, (hpg + 2) * hd, *w.shape[1:])
                parts = [g[:, :hpg * hd].reshape(heads * hd, *w.shape[1:]),
                         g[:, hpg * hd:hpg * hd + hd].reshape(groups * hd, *w.shape[1:]),
                         g[:, hpg * hd + hd:].reshape(groups * hd, *w.shape[1:])]
            else:  # GATED
                parts = list(torch.chunk(w, 2, dim=0))
            for name, part in zip(names, parts, strict=True):
                val = part.to(torch.float32) + 1.0 if rule.transform == "plus_one" else part
                out[name] = val.to(getattr(torch, rule.dtype) if rule.dtype else dtype).contiguous()
    return out


def _slices(t: torch.Tensor, stacked: bool, expert: bool, key_layer: int | None):
    """(layer, expert, tensor) for each layer (a leading axis if stacked, else the key's) and
    each expert (the next axis of an expert rule)."""
    for layer in (range(t.shape[0]) if stacked else [key_layer]):
        w = t[layer] if stacked else t
        for e in (range(w.shape[0]) if expert else [None]):
            yield layer, e, (w[e] if expert else w)


def dense_export(model, family: Family, vocab_size: int, dtype: torch.dtype = torch.bfloat16,
                 dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Gather + convert: the Hugging Face state dict a dense refit would load (on rank dst).
    Every rank must call it (collective)."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    full = gather_megatron(model, dst)
    if full is None:
        return None
    return to_hf(full, family, inner.config, vocab_size,
                 getattr(inner, "share_embeddings_and_output_weights", False), dtype)
