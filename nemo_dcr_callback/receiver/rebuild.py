"""Weights rebuilt from the store alone: keyframes and the committed chain after them."""

from __future__ import annotations

from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.protocol import commit, keys


class KeyframeError(ValueError):
    """A keyframe that does not parse, or whose tensors differ from its record's digests."""


def load_keyframe(store, k: int) -> tuple[dict, bytes]:
    """Keyframe k's tensors (and the file's bytes), checked against its record: a corrupt or
    replaced keyframe is refused with its key named, before any receiver starts from it."""
    from safetensors.torch import load

    key = keys.keyframe_model(k)
    blob = store.get(key)
    try:
        tensors = load(blob)
    except Exception as exc:  # (safetensors raises its own SafetensorError, and others on odd headers)
        raise KeyframeError(f"{key}: not a valid safetensors file ({exc})") from None
    rec = commit.read_keyframe(store, k)
    if rec is not None:
        ref = rec["digests"]
        bad = sorted(n for n in set(ref) | set(tensors)
                     if n not in tensors or n not in ref or digest.hexd(digest.sum64(tensors[n])) != ref[n])
        if bad:
            raise KeyframeError(f"{key}: tensor {bad[0]!r} differs from {keys.keyframe_record(k)} "
                                f"({len(bad)} tensors): a corrupt or replaced keyframe")
    return tensors, blob


def latest_keyframe(store) -> int | None:
    """The newest keyframe of a committed version (or version 0)."""
    for k in reversed(commit.keyframes(store)):
        d = commit.read_decision(store, k)
        if k == 0 or (d and d["decision"] == "commit"):
            return k
    return None


def reconstruct(store, v: int) -> dict:
    """The canonical tensors of committed version v, rebuilt from the newest committed keyframe
    at or before v plus the committed deltas after it, every step checked against the
    version records' digests (a restarted sender rebases on this)."""
    from nemo_dcr_callback.receiver.follow import Follower  # (follow.py re-exports this module's names)

    kfs = [k for k in commit.keyframes(store) if k <= v and (k == 0 or (commit.read_decision(store, k) or {})
                                                              .get("decision") == "commit")]
    if not kfs:
        raise KeyError(f"no keyframe at or before version {v} to rebuild it from")
    k = kfs[-1]
    tensors, _ = load_keyframe(store, k)
    f = Follower(store, tensors, version=k)
    for u in [u for u in commit.list_versions(store) if k < u <= v]:
        d = commit.read_decision(store, u)
        if d is not None and d["decision"] == "commit":  # committed versions form one chain
            f.apply_version(u, wait_decision=False)
    if f.version != v:
        raise KeyError(f"version {v} is not committed (rebuilt up to {f.version})")
    return tensors
