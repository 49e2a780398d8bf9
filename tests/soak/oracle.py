"""The soak's dense oracle on a sample (invariant 1 of invariants.py): a receiver's held
weights against the dense export of the version it holds. A directory receiver is stopped while
its files are read (the FP8 one is compared with the export converted by fp8-init's code); the
vLLM engine's weights are read back through its loader's copies (dcr_check_export)."""

from __future__ import annotations

import json
import signal
import tempfile
import time
from pathlib import Path

from nemo_dcr_callback.protocol import commit, keys


class DenseOracle:
    """Mixed into invariants.Watch: uses its procs, store, samples, t0 and violate()."""

    def sample(self, model_dir: Path, fp8_dir: Path, vllm_base: str | None, final: bool = False) -> None:
        """One receiver's held weights against the dense export of the version it holds (at the
        end: every one of them)."""
        names = ["rx-dir", "rx-fp8", *(["rx-vllm"] if vllm_base else [])]
        for name in names if final else [names[len(self.samples) % len(names)]]:
            if name == "rx-vllm":
                self._sample_vllm(vllm_base)
            else:
                self._sample(name, model_dir if name == "rx-dir" else fp8_dir, final)

    def _sample_vllm(self, base: str) -> None:
        """The engine's weights read back in canonical coordinates through vLLM's loader copies,
        against the export (the worker extension's dcr_check_export)."""
        from nemo_dcr_callback.integrations.vllm_serve import rpc

        row = {"t": round(time.monotonic() - self.t0, 1), "receiver": "rx-vllm"}
        p = self.procs["rx-vllm"]
        if p.stopped or not p.alive():
            self.samples.append({**row, "skipped": "under a fault"})
            return
        try:
            v = int(rpc(base, "dcr_version")[0])
            res = rpc(base, "dcr_check_export", version=v)[0]
        except Exception as exc:  # noqa: BLE001 - starting, moved on meanwhile, or its export collected
            self.samples.append({**row, "skipped": f"{type(exc).__name__}"})
            return
        row.update(version=v, tensors=res["checked"], bit_exact=not res["differ"])
        self.samples.append(row)
        if res["differ"]:
            self.violate(f"rx-vllm holds version {v} but {res['differ'][0]} ({len(res['differ'])} tensors) "
                         "differs from the dense export")

    def _sample(self, name: str, path: Path, final: bool) -> None:
        from safetensors.torch import load, save_file

        from nemo_dcr_callback.core.rawbits import bits
        from nemo_dcr_callback.receiver.targets.fp8_dir import convert

        p = self.procs[name]
        row = {"t": round(time.monotonic() - self.t0, 1), "receiver": name}
        if p.stopped or not p.alive():
            self.samples.append({**row, "skipped": "under a fault"})
            return
        p.signal(signal.SIGSTOP)
        try:
            st = json.loads((path / ".nemo-dcr" / "state.json").read_text())
            files = {f.name: f.read_bytes() for f in path.glob("*.safetensors")}
        except (OSError, ValueError) as exc:
            self.samples.append({**row, "skipped": f"unreadable: {exc}"})
            return
        finally:
            if not p.stopped:
                p.signal(signal.SIGCONT)
        v = st["version"]
        row["version"] = v
        if st.get("pending"):
            self.samples.append({**row, "skipped": "mid-apply"})
            return
        try:
            key = commit.verify_key(v) if self.store.exists(commit.verify_key(v)) else keys.keyframe_model(v)
            ref = self.store.get(key)
        except Exception as exc:  # noqa: BLE001 - gc'd (an old version), or S3 under a fault
            self.samples.append({**row, "skipped": f"no export: {type(exc).__name__}"})
            return
        if name == "rx-fp8":
            with tempfile.TemporaryDirectory() as tmp:
                save_file(load(ref), f"{tmp}/model.safetensors")
                convert(f"{tmp}/model.safetensors", f"{tmp}/fp8", version=v)
                want = load(Path(f"{tmp}/fp8/model.safetensors").read_bytes())
        else:
            want = load(ref)
        got = {}
        for blob in files.values():
            got.update(load(blob))
        bad = sorted(n for n in want if n not in got or got[n].shape != want[n].shape
                     or not bits(got[n].contiguous()).equal(bits(want[n].contiguous())))
        row["tensors"], row["bit_exact"] = len(want), not bad
        self.samples.append(row)
        if bad:
            self.violate(f"{name} holds version {v} but {bad[0]} ({len(bad)} tensors) differs from the dense "
                         f"{'export converted to FP8' if name == 'rx-fp8' else 'export'}")
