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
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

try:  # lightning 2.x; NeMo 2 re-exports the same class
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - pytorch_lightning-only installs
    from pytorch_lightning import Callback  # type: ignore[no-redef]

if TYPE_CHECKING:
    from nemo_dcr_callback.protocol.commit import CommitPolicy
    from nemo_dcr_callback.receiver.follow import FollowerConfig
    from nemo_dcr_callback.sender.publisher import PublisherConfig


# Benchmark instrumentation (`nemo-dcr bench overhead --alternate K`): publish only in every
# other block of K steps, so that one run measures steps with and without the callback a few
# seconds apart (host drift between separate runs is larger than the effect measured).
ALTERNATE_ENV = "NEMO_DCR_BENCH_ALTERNATE"


@dataclass
class DCRConfig:
    """Every option of the callback (configs/dcr.yaml documents each one). The fields are flat:
    they are the YAML surface (`dcr.store=...`). The components' configs are built from them
    (publisher_config, verifier_config), which import the components' modules: a DCRConfig
    alone stays light to build."""

    store: str | None = None  # URL (file:///path); None: file://<trainer.default_root_dir>/dcr-store
    family: str = "llama"  # placement table (nemo_dcr_callback.placement.FAMILIES)
    vocab_size: int | None = None  # the tokenizer's vocabulary; None: pl_module.dcr_vocab_size
    every_n_steps: int = 1  # publish a version every N optimizer steps
    max_pending_bytes: int = 1 << 30  # undo-log bytes queued for upload before publish() blocks
    chunk_span: int = 1 << 24  # positions per chunk
    zstd_level: int = 1  # for zstd-coded streams
    keyframe: bool = True  # write the dense export of version 0 as the receivers' starting point
    verify: bool = False  # check every version bit for bit against the dense export (slow)
    seal_timeout: float = 600.0  # seconds rank 0 waits for every rank's manifest
    commit_policy: str = "quorum"  # wait | abort | quorum: what to do about slow or refusing receivers
    ack_timeout: float = 60.0  # seconds the committer waits for receivers' acks
    quorum: float = 0.5  # quorum policy: fraction of registered receivers that must ack
    keyframe_every: int = 0  # also write a full keyframe every N versions (0: only version 0)
    part_bytes: int = 4 << 20  # chunks are uploaded in parts of about this size, as soon as full
    baseline: str = "gpu"  # CUDA shards: baselines in GPU memory (gpu) or pinned host memory (pinned)
    resume: bool = True  # a store with versions: rebase on its last committed one (a restarted job)

    def commit_policy_config(self) -> CommitPolicy:
        """What the committer (rank 0) does about slow or refusing receivers."""
        from nemo_dcr_callback.protocol.commit import CommitPolicy

        return CommitPolicy(self.commit_policy, self.ack_timeout, self.quorum)

    def publisher_config(self) -> PublisherConfig:
        """Every rank's Publisher."""
        from nemo_dcr_callback.sender.publisher import PublisherConfig

        return PublisherConfig(max_pending_bytes=self.max_pending_bytes, span=self.chunk_span, level=self.zstd_level,
                               seal_timeout=self.seal_timeout, policy=self.commit_policy_config(),
                               part_bytes=self.part_bytes, baseline=self.baseline, resume=self.resume)

    def verifier_config(self) -> FollowerConfig:
        """The `verify` option's in-process receiver on rank 0: no receiver id (it does not
        take part in the commit), digests checked, the default timeouts."""
        from nemo_dcr_callback.receiver.follow import FollowerConfig

        return FollowerConfig()


def _log_step(trainer, default: int) -> int:
    """The step Lightning's self.log would log at (its loop's count of batches that stepped),
    so the callback's rows line up with the module's; default where a trainer has no such loop."""
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return default


class DCRCallback(Callback):
    def __init__(self, store: str | None = None, family: str = "llama", vocab_size: int | None = None,
                 every_n_steps: int = 1, max_pending_bytes: int = 1 << 30, chunk_span: int = 1 << 24,
                 zstd_level: int = 1, keyframe: bool = True, verify: bool = False, seal_timeout: float = 600.0,
                 commit_policy: str = "quorum", ack_timeout: float = 60.0, quorum: float = 0.5,
                 keyframe_every: int = 0, part_bytes: int = 4 << 20, baseline: str = "gpu", resume: bool = True,
                 **unknown):
        if unknown:
            raise TypeError(f"DCRCallback: unknown options {sorted(unknown)} (see configs/dcr.yaml)")
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        from nemo_dcr_callback.core.cuda_kernels import check_baseline_option

        try:
            check_baseline_option(baseline)
        except ValueError as exc:
            raise ValueError(f"DCRCallback: {exc}") from None
        self.cfg = DCRConfig(store, family, vocab_size, every_n_steps, max_pending_bytes, chunk_span, zstd_level,
                             keyframe, verify, seal_timeout, commit_policy, ack_timeout, quorum, keyframe_every,
                             part_bytes, baseline, resume)
        self.policy = self.cfg.commit_policy_config()  # validates the options now
        self.publisher = None
        self.steps = 0
        self._offset = 0
        self._verifier = None
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
        import torch.distributed as dist

        from nemo_dcr_callback.placement import FAMILIES, dense_export
        from nemo_dcr_callback.protocol import commit
        from nemo_dcr_callback.receiver import Follower
        from nemo_dcr_callback.receiver.rebuild import reconstruct
        from nemo_dcr_callback.sender.publisher import Publisher
        from nemo_dcr_callback.transport.store import open_store

        if self.cfg.family not in FAMILIES:
            raise ValueError(f"DCRCallback: unknown family {self.cfg.family!r} (have {sorted(FAMILIES)})")
        family = FAMILIES[self.cfg.family]
        model, vocab = self._model(pl_module), self._vocab(pl_module)
        store = open_store(self._store_url(trainer))
        rank = dist.get_rank() if dist.is_initialized() else 0
        resuming = self.cfg.resume and bool(commit.list_versions(store))
        if (self.cfg.keyframe or self.cfg.verify) and not resuming:
            exp = dense_export(model, family, vocab)
            if rank == 0:
                hf = getattr(pl_module, "dcr_hf_config", None)
                commit.write_keyframe(store, 0, exp, hf().to_json_string() if hf is not None else None)
                if self.cfg.verify:
                    self._verifier = Follower(store, {k: v.clone() for k, v in exp.items()}, version=0,
                                              config=self.cfg.verifier_config())
        # resume only a store that held versions before this job wrote its keyframe
        pub_cfg = replace(self.cfg.publisher_config(), resume=resuming)
        self.publisher = Publisher(model, family=family, vocab_size=vocab, store=store, config=pub_cfg)
        self._offset = self.publisher.version_offset  # versions continue after the store's newest
        if resuming and self.cfg.verify and rank == 0:
            last = self.publisher.resumed_from
            self._verifier = Follower(store, reconstruct(store, last), version=last, config=self.cfg.verifier_config())
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
        t0 = time.perf_counter()
        version = self._offset + self.steps
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
            self._verify(version)
        elif self.cfg.keyframe_every and self.steps % (self.cfg.keyframe_every * self.cfg.every_n_steps) == 0:
            self._keyframe(version, pl_module)

    def _keyframe(self, version: int, pl_module) -> None:
        """A full canonical checkpoint of `version` (a collective: every rank takes part in the
        dense export; rank 0 writes it). Receivers use it once the version is committed."""
        import torch.distributed as dist

        from nemo_dcr_callback.placement import dense_export
        from nemo_dcr_callback.protocol import commit

        exp = dense_export(self._model_ref, self._family, self._vocab_n)
        if not dist.is_initialized() or dist.get_rank() == 0:
            hf = getattr(pl_module, "dcr_hf_config", None)
            commit.write_keyframe(self.publisher.store, version, exp, hf().to_json_string() if hf is not None else None)

    def _verify(self, version: int) -> None:
        """Receiver-side check, on rank 0, against the dense export (collective)."""
        from nemo_dcr_callback.core.bitops import bits
        from nemo_dcr_callback.placement import dense_export

        self.publisher.flush()
        exp = dense_export(self._model_ref, self._family, self._vocab_n)
        if self._verifier is None:
            return
        from safetensors.torch import save

        from nemo_dcr_callback.protocol import commit

        # For receivers elsewhere (nemo-dcr receive --verify) to compare with, too.
        self.publisher.store.put(commit.verify_key(version), save(exp))
        t0 = time.perf_counter()
        self._verifier.follow(until=version, timeout=self.cfg.seal_timeout)
        for name, ref in exp.items():
            got = self._verifier.tensors[name]  # the verifier follows a plain state dict
            if not torch.equal(bits(ref), bits(got)):
                raise RuntimeError(f"dcr verify: version {version}: tensor {name} differs from the dense export")
        print(f"dcr: version {version}: receiver bit-exact with the dense export ({len(exp)} tensors, "
              f"follow+check {1e3 * (time.perf_counter() - t0):.0f} ms)", flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.publisher is not None:
            try:
                self.publisher.close()
            except Exception:  # noqa: BLE001 - the training exception is the one to report
                pass

    def state_dict(self) -> dict:
        return {"steps": self.steps, "config": asdict(self.cfg)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = int(state_dict.get("steps", 0))
