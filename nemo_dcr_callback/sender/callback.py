"""DCRCallback: the Lightning / NeMo face of nemo-dcr.

Add it to a trainer (YAML: `trainer.callbacks: [{_target_: nemo_dcr_callback.DCRCallback, ...}]`)
whose LightningModule trains a megatron-core model. After every `every_n_steps` optimizer steps
it publishes a version: the delta kernel runs at once on this rank's shards (before the next
step mutates them), projection, encoding and upload run in a background thread with a memory
budget and back-pressure; a background failure is raised in the training loop at the next
step. Metrics (rank 0's) go to the trainer's logger under `dcr/`; every rank's per-version
figures are written to the store (stats/rank-NNNNN.json) when training ends.

The callback finds the Megatron model through `pl_module.dcr_model()` if the module defines
it, else `pl_module.module` (NeMo's MegatronParallel: its first chunk). It needs
torch.distributed and Megatron's parallel state initialised (the module's setup does that).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from safetensors.torch import save

try:  # lightning 2.x; NeMo 2 re-exports the same class
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - pytorch_lightning-only installs
    from pytorch_lightning import Callback  # type: ignore[no-redef]

from nemo_dcr_callback.config import DCRConfig
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.placement import FAMILIES, dense_export
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.rebuild import Replica, reconstruct
from nemo_dcr_callback.sender.publisher import Publisher
from nemo_dcr_callback.transport.patient import PatientStore
from nemo_dcr_callback.transport.store import open_store

# Benchmark instrumentation (`nemo-dcr bench overhead --alternate K`): publish only in every
# other block of K steps, so that one run measures steps with and without the callback a few
# seconds apart (host drift between separate runs is larger than the effect measured).
ALTERNATE_ENV = "NEMO_DCR_BENCH_ALTERNATE"


def _log_step(trainer, default: int) -> int:
    """The step Lightning's self.log would log at (its loop's count of batches that stepped),
    so the callback's rows line up with the module's; default where a trainer has no such loop."""
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return default


class DCRCallback(Callback):
    """Takes a DCRConfig, or its fields as keyword arguments (the flat YAML keys Hydra passes),
    or both: the keywords override the config's fields."""

    def __init__(self, config: DCRConfig | None = None, **options):
        unknown = sorted(set(options) - set(DCRConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(f"DCRCallback: unknown options {unknown} (see configs/dcr.yaml)")
        try:
            self.cfg = replace(config or DCRConfig(), **options)
        except ValueError as exc:
            raise ValueError(f"DCRCallback: {exc}") from None
        self.publisher: Publisher | None = None
        self.steps = 0
        self._offset = 0
        self._verifier: Replica | None = None
        self._alternate = int(os.environ.get(ALTERNATE_ENV) or 0)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _model(pl_module):
        if hasattr(pl_module, "dcr_model"):
            return pl_module.dcr_model()
        mod = getattr(pl_module, "module", None)
        if mod is not None:
            return mod[0] if isinstance(mod, (list, tuple, torch.nn.ModuleList)) else mod
        raise TypeError("DCRCallback: the LightningModule must define dcr_model() (the megatron-core model "
                        "chunk) or hold it as .module")

    def _vocab(self, pl_module) -> int:
        v = self.cfg.vocab_size or getattr(pl_module, "dcr_vocab_size", None)
        if v is None:
            raise ValueError("DCRCallback: vocab_size is not set (option vocab_size or pl_module.dcr_vocab_size)")
        return int(v)

    def _store_url(self, trainer) -> str:
        if self.cfg.store:
            return self.cfg.store
        return "file://" + os.path.abspath(os.path.join(trainer.default_root_dir, "dcr-store"))

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        if self.cfg.family not in FAMILIES:
            raise ValueError(f"DCRCallback: unknown family {self.cfg.family!r} (have {sorted(FAMILIES)})")
        family = FAMILIES[self.cfg.family]
        model, vocab = self._model(pl_module), self._vocab(pl_module)
        rank = dist.get_rank() if dist.is_initialized() else 0
        # start-up too rides out a store outage (a job restarted while S3 restarts)
        store = PatientStore(open_store(self._store_url(trainer)), self.cfg.store_patience_s, who=f"dcr rank {rank}")
        resuming = self.cfg.resume and bool(commit.list_versions(store))
        if (self.cfg.keyframe or self.cfg.verify) and not resuming:
            exp = dense_export(model, family, vocab)
            if rank == 0:
                hf = getattr(pl_module, "dcr_hf_config", None)
                commit.write_keyframe(store, 0, exp, hf().to_json_string() if hf is not None else None)
                if self.cfg.verify:
                    self._verifier = Replica(store, {k: v.clone() for k, v in exp.items()}, version=0)
        # resume only a store that held versions before this job wrote its keyframe
        pub_cfg = replace(self.cfg.publisher_config(), resume=resuming)
        self.publisher = Publisher(model, family=family, vocab_size=vocab, store=store, config=pub_cfg)
        self._offset = self.publisher.version_offset  # versions continue after the store's newest
        # a step blocked on back-pressure leaves on SIGTERM (Lightning's flag) rather than wait
        self.publisher.stop_requested = lambda: bool(getattr(trainer, "received_sigterm", False))
        if resuming and self.cfg.verify and rank == 0:
            last = self.publisher.resumed_from
            self._verifier = Replica(store, reconstruct(store, last), version=last)
        self._family, self._vocab_n, self._model_ref = family, vocab, model
        if rank == 0:
            print(f"dcr: publishing to {store.url} every {self.cfg.every_n_steps} step(s) "
                  f"({len(self.publisher.placement.params)} params on rank 0)", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += 1
        if self.publisher is None or self.steps % self.cfg.every_n_steps:
            return
        if self._alternate and (batch_idx // self._alternate) % 2:
            return  # bench overhead --alternate: an "off" block
        version = self._offset + self.steps
        n = self.steps // self.cfg.every_n_steps
        exp, exported = None, False  # (the dense export is rank 0's: None on the other ranks)
        if not self.cfg.verify and self.cfg.export_every and n % self.cfg.export_every == 0:
            # before the publish: once a receiver can apply the version, its export is there
            # (or never will be: a store error here stops the step, and nothing is published)
            exp, exported = self._write_dense(version, pl_module, None, keyframe=False, export=True), True
        t0 = time.perf_counter()
        st = self.publisher.publish(version)
        if self.publisher.rank == 0:  # rank 0's figures (every rank's are in the store's stats/ at the end):
            # logging on every rank cost each rank about 1 ms a step, a sixth of the callback's own time
            metrics = {"dcr/kernel_ms": 1e3 * st.kernel_s, "dcr/publish_ms": 1e3 * (time.perf_counter() - t0)}
            done = self.publisher.history[-1] if self.publisher.history else None
            if done is not None:
                metrics.update({"dcr/change_rate": done.changed / max(done.params, 1),
                                "dcr/bytes": float(done.bytes), "dcr/ratio": 2.0 * done.params / max(done.bytes, 1),
                                "dcr/encode_ms": 1e3 * done.encode_s, "dcr/upload_ms": 1e3 * done.upload_s})
            if self.steps % max(getattr(trainer, "log_every_n_steps", 1), 1) == 0:
                # straight to the loggers: pl_module.log_dict took 4.7 ms a step on rank 0 here
                # (Lightning's result collection: more than the delta kernel, on the pipeline's
                # first stage), CSVLogger.log_metrics microseconds
                step = _log_step(trainer, self.steps - 1)
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
        if self.cfg.verify:
            exp, exported = self._verify(version), True
        if self.cfg.keyframe_every and n % self.cfg.keyframe_every == 0:
            self._write_dense(version, pl_module, exp, keyframe=True, export=False, exported=exported)

    def _write_dense(self, version: int, pl_module, exp: dict | None, keyframe: bool, export: bool,
                     exported: bool = False) -> dict | None:
        """A full canonical checkpoint of `version` (keyframe: receivers start from it once the
        version is committed) and/or its dense export for --verify. The export is a collective
        (every rank takes part); rank 0 writes."""
        if not exported:
            exp = dense_export(self._model_ref, self._family, self._vocab_n)
        if dist.is_initialized() and dist.get_rank() != 0:
            return exp
        if export:
            self.publisher.store.put(commit.verify_key(version), save(exp))
        if keyframe:
            hf = getattr(pl_module, "dcr_hf_config", None)
            commit.write_keyframe(self.publisher.store, version, exp, hf().to_json_string() if hf is not None else None)
        return exp

    def _verify(self, version: int) -> dict:
        """The store's committed chain, replayed on rank 0 (protocol.rebuild.Replica: parts
        checked against manifests, chunks decoded, digests checked), against the dense export
        (a collective). Independent of the receivers' own code, so it checks what they read."""
        self.publisher.flush()
        exp = dense_export(self._model_ref, self._family, self._vocab_n)
        if self._verifier is None:
            return exp
        # For receivers elsewhere (nemo-dcr receive --verify) to compare with, too.
        self.publisher.store.put(commit.verify_key(version), save(exp))
        t0 = time.perf_counter()
        if self._verifier.catch_up(version) != version:
            raise RuntimeError(f"dcr verify: version {version} was not committed "
                               f"({commit.read_decision(self.publisher.store, version)})")
        for name, ref in exp.items():
            got = self._verifier.tensors[name]
            if not torch.equal(bits(ref), bits(got)):
                raise RuntimeError(f"dcr verify: version {version}: tensor {name} differs from the dense export")
        # (tests read this line: the changes counted show that the weights moved)
        print(f"dcr: version {version}: the store's chain is bit-exact with the dense export ({len(exp)} tensors, "
              f"{self._verifier.changed.get(version, 0)} changed; replay+check "
              f"{1e3 * (time.perf_counter() - t0):.0f} ms)", flush=True)
        return exp

    @property
    def version(self) -> int:
        """The version the trainer's weights are now: the last one published (0 before the
        first; an RL loop measures its rollouts' staleness against it)."""
        return self._offset + self.steps - self.steps % self.cfg.every_n_steps

    def on_train_end(self, trainer, pl_module) -> None:
        """Every queued version decided, unless the end is a stop (SIGTERM): then at most
        stop_timeout_s."""
        if self.publisher is not None:
            stopping = bool(getattr(trainer, "received_sigterm", False))
            self.publisher.close(self.cfg.stop_timeout_s if stopping else None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.publisher is not None:
            try:
                self.publisher.close(self.cfg.stop_timeout_s)
            except Exception:  # noqa: BLE001 - the training exception is the one to report
                pass

    def state_dict(self) -> dict:
        return {"steps": self.steps, "config": asdict(self.cfg)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = int(state_dict.get("steps", 0))
