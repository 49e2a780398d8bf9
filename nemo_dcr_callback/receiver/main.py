"""`nemo-dcr receive`: a rollout-side receiver following a store with a Hugging Face model."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.protocol.rebuild import latest_keyframe, load_keyframe
from nemo_dcr_callback.protocol.records import read_limit
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver.follow import FETCH_LANES, Applied, Follower, FollowerConfig
from nemo_dcr_callback.receiver.targets import CheckpointDirTarget, LoaderTarget
from nemo_dcr_callback.receiver.targets.fp8_dir import Fp8DirTarget
from nemo_dcr_callback.transport.store import freeze_long_lived, open_store


def load_model(store, hf_model: str | None, timeout: float):
    """The receiver's model and the version it holds: a Hugging Face directory (version 0), or
    the store's newest keyframe of a committed version (waited for, then loaded through
    transformers' own loader). The newest, not 0: gc deletes older keyframes, and a receiver
    restarted late would otherwise replay every version since 0, if they were still there."""
    # start-up cost: transformers takes ~0.8 s to import; --model-dir and --fp8-dir never load it
    from transformers import AutoModelForCausalLM

    if hf_model is not None:
        return AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.bfloat16), 0
    deadline = time.monotonic() + timeout
    failing: StoreError | None = None
    while True:
        try:
            k = latest_keyframe(store)
            if k is not None and store.exists(keys.keyframe_config(k)):
                _, blob = load_keyframe(store, k)  # (checked before transformers sees it)
                config = store.get(keys.keyframe_config(k), limit=read_limit(keys.keyframe_config(k)))
                break
        except KeyError:  # gc deleted it under us: a newer one is there
            pass
        except StoreError as exc:  # the store is failing (a 5xx, a restart): retried until the deadline
            if failing is None:
                print(f"nemo-dcr receiver: store unavailable at start-up ({exc}); retrying for up to "
                      f"{max(0.0, deadline - time.monotonic()):.0f} s", file=sys.stderr, flush=True)
            failing = exc
        if time.monotonic() > deadline:
            if failing is not None:
                raise TimeoutError(f"no keyframe read from the store in {timeout:.0f} s: it kept failing ({failing})")
            raise TimeoutError(f"no keyframe in the store after {timeout:.0f} s")
        time.sleep(0.1 if failing is None else 0.5)
    tmp = Path(tempfile.mkdtemp(prefix="nemo-dcr-keyframe."))
    try:
        (tmp / keys.CONFIG_FILE).write_bytes(config)
        (tmp / keys.MODEL_FILE).write_bytes(blob)
        del blob
        return AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.bfloat16), k
    finally:  # (the weights are in memory now; a receiver restarted often filled /tmp with copies)
        shutil.rmtree(tmp, ignore_errors=True)


def verify_version(store, v: int, tensors: dict[str, torch.Tensor], timeout: float = 120.0) -> str | None:
    """Compare with the dense export of version v (the trainer writes it just after sealing
    the version, so wait for it); the first mismatching tensor, or None."""
    deadline = time.monotonic() + timeout
    while not store.exists(commit.verify_key(v)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no dense export of version {v} to verify against after {timeout:.0f} s")
        time.sleep(0.05)
    ref = load(store.get(commit.verify_key(v), limit=read_limit(commit.verify_key(v))))
    for name, t in ref.items():
        mine = tensors.get(name)
        if mine is not None and mine.device != t.device:  # a model on a GPU (--device): compared on the host
            mine = mine.cpu()
        if mine is None or mine.shape != t.shape or not torch.equal(bits(mine.contiguous()), bits(t.contiguous())):
            return name
    return None


def _device(name: str) -> torch.device:
    """The receiver's device, refused by name where it cannot be used."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA device here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA devices here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def _emit(json_lines: bool, text: str, **fields) -> None:
    """One line of progress: the text, or with --json the fields as one JSON object (for fleet
    tooling to read)."""
    print(json.dumps(fields) if json_lines else text, flush=True)


def _fields(a: Applied) -> dict:
    return {"event": "applied", "version": a.version, "base": a.base, "changed": a.changed, "chunks": a.chunks,
            "bytes": a.bytes, "fetch_ms": round(1e3 * a.fetch_s, 3), "apply_ms": round(1e3 * a.apply_s, 3),
            "decision_wait_ms": round(1e3 * a.wait_s, 3), "digests_checked": a.digest_checked,
            "digests_unchecked": a.unchecked}


def _digest_note(a: Applied) -> str:
    """The receive line's digest check, saying so when the model holds some tensors only in
    part (a loader that keeps a shard): those tensors' digests cannot be read back."""
    if not a.digest_checked:
        return ""
    return ", digests match" + (f" ({a.unchecked} tensors held in part: not checked)" if a.unchecked else "")


def run_receive(url: str, hf_model: str | None, follow: bool, until: int | None, verify: bool,
                timeout: float, apply: str = "loader", receiver_id: str | None = None,
                fetch_lanes: int = FETCH_LANES, idle_poll_s: float = 0.1, json_lines: bool = False,
                device: str = "cpu") -> int:
    cfg = FollowerConfig(receiver_id=receiver_id, fetch_lanes=fetch_lanes, idle_poll_s=idle_poll_s)
    dev = _device(device)  # (refused before the model is loaded: seconds to minutes)
    store = open_store(url)
    model, held = load_model(store, hf_model, timeout)
    if dev.type != "cpu":
        model.to(dev)
    tensors = model.state_dict()
    if apply == "loader":  # through the model's own loading code (load_state_dict), see targets/loader.py
        shapes = {k: (v.shape, v.dtype) for k, v in tensors.items()}
        target = LoaderTarget(model, lambda items: model.load_state_dict(dict(items), strict=False), shapes)
        f = Follower(store, target, version=held, config=cfg)
    else:
        f = Follower(store, tensors, version=held, config=cfg)
    freeze_long_lived()
    tied = model.config.tie_word_embeddings
    n_params = sum(t.numel() for n, t in tensors.items() if n != "lm_head.weight" or not tied)
    _emit(json_lines, f"receiver: {n_params / 1e6:.1f}M-param {type(model).__name__}, holding version {held}",
          event="ready", model=type(model).__name__, params=n_params, version=held)

    def on_apply(a: Applied) -> None:
        line = (f"receiver: version {a.version} (base {a.base}): {a.changed} changed, {a.chunks} chunks, "
                f"{a.bytes} bytes, fetch+verify {1e3 * a.fetch_s:.1f} ms, apply {1e3 * a.apply_s:.1f} ms"
                + _digest_note(a))
        fields = _fields(a)
        if verify:
            bad = verify_version(store, a.version, tensors, timeout)
            fields.update(bit_exact=bad is None, mismatch=bad)
            if bad is not None:
                _emit(json_lines, line + f"; MISMATCH in {bad} vs the dense export", **fields)
                raise SystemExit(3)
            line += "; bit-exact with the dense export"
        _emit(json_lines, line, **fields)

    return _follow(f, follow, until, timeout, on_apply)


def _follow(f: Follower, follow: bool, until: int | None, timeout: float, on_apply) -> int:
    """Apply what is there (or keep following); a refused version is an exit status 2."""
    try:
        if follow:
            f.follow(until=until, timeout=timeout, on_apply=on_apply)
        else:
            f.poll(on_apply, until)
    except (codec.ChunkError, TimeoutError, KeyError, OSError) as exc:
        print(f"nemo-dcr receive: error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_receive_dir(url: str, model_dir: str, follow: bool, until: int | None, timeout: float,
                    receiver_id: str | None = None, fetch_lanes: int = FETCH_LANES,
                    idle_poll_s: float = 0.1, json_lines: bool = False, fp8: bool = False) -> int:
    """Patch a checkpoint directory in place (crash-safe, see targets.CheckpointDirTarget);
    fp8: a block-FP8 directory, requantized where a version changed it (targets/fp8_dir.py)."""
    cfg = FollowerConfig(receiver_id=receiver_id, fetch_lanes=fetch_lanes, idle_poll_s=idle_poll_s)
    store = open_store(url)
    target = (Fp8DirTarget if fp8 else CheckpointDirTarget)(model_dir)
    f = Follower(store, target, version=target.version, config=cfg)
    freeze_long_lived()
    _emit(json_lines, f"receiver: {model_dir} holds version {target.version}", event="ready",
          model_dir=str(model_dir), version=target.version)

    def on_apply(a: Applied) -> None:
        _emit(json_lines, f"receiver: version {a.version} (base {a.base}): {a.changed} changed, {a.chunks} chunks, "
              f"{a.bytes} bytes, applied in place in {1e3 * a.apply_s:.1f} ms"
              + _digest_note(a), **_fields(a))

    try:
        return _follow(f, follow, until, timeout, on_apply)
    finally:
        target.close()
