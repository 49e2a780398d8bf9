"""The RL loop's trainer (`nemo-dcr demo --rl`): a megatron-core policy trained on rollouts a
vLLM engine generates while it follows the trainer's versions, published by the DCR callback
after every step (a Hydra app, one process per rank, like recipes/train.py):

    torchrun --nproc-per-node 2 -m nemo_dcr_callback.recipes.rl_train rl.rollouts=DIR dcr.store=URL

The rollout worker (recipes/rl_rollout.py) writes batches of episodes to `rl.rollouts`; each
token of the policy's carries the version that sampled it and its logprob under that policy
(the behaviour policy mu: the engine applies new versions while episodes are in flight, so an
episode may span several). Rank 0 takes the batches in order; a group with a token more than
`rl.max_staleness` versions behind the trainer's weights (DCRCallback.version) is dropped, and
a batch with nothing left, both counted. The loss is the truncated importance-sampling policy
gradient (tis_step: weights min(pi / mu, rl.delta) on GRPO's advantages). A batch is a claim
from a folder others may write: rank 0 reads it without following links and within a size,
and trains only on episodes that fit the model (rl_task.read_batch); a bad batch or episode is
skipped with a warning naming the file, never a stop. Every rank trains on what rank 0 chose
(one broadcast). Each step's record goes to `<rollouts>/trainer.jsonl`.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from nemo_dcr_callback.recipes import rl_task
from nemo_dcr_callback.recipes.train import CONFIGS

STEP_LOG = "trainer.jsonl"


class NoRollouts(RuntimeError):
    pass


class RolloutQueue:
    """Rank 0's view of the rollout folder: batch files in the order written (r-NNNNNN.json,
    renamed into place whole), a cursor, and the staleness rule. Each batch is checked
    (rl_task.read_batch) against the trainer's published versions, its sequence length and
    vocabulary: a bad batch or episode is skipped with one warning naming the file and why,
    never a stop of training."""

    def __init__(self, folder: str, max_staleness: int, timeout_s: float, micro: int = 1,
                 max_tokens: int = rl_task.SEQ + 1, vocab: int = rl_task.VOCAB):
        self.dir, self.k, self.timeout_s = Path(folder), max_staleness, timeout_s
        self.micro, self.max_tokens, self.vocab = micro, max_tokens, vocab
        self.next = 0
        self.dropped: list[dict] = []
        self.dropped_groups = self.dropped_episodes = 0  # out of batches that were taken
        self.skipped: list[dict] = []  # batches refused whole: {"batch", "reason"}
        self._cursor_said = False

    def _advance(self) -> None:
        self.next += 1
        try:
            rl_task.write_whole(self.dir / rl_task.CURSOR, str(self.next))
        except OSError as exc:  # (the worker then paces on the old cursor: said once, training goes on)
            if not self._cursor_said:
                rl_task.warn(f"cannot write the cursor {self.dir / rl_task.CURSOR}: {exc}")
                self._cursor_said = True

    def _skip(self, reason: str) -> None:
        self.skipped.append({"batch": self.next - 1, "reason": reason})
        rl_task.warn(f"skipped rollout batch {self.next - 1}: {reason}")

    def take(self, version: int) -> dict:
        """The next batch at most k versions behind `version`, waiting for the worker: a group
        (a prompt's episodes) with a token sampled more than k versions ago is dropped, and a
        batch with nothing left with it (both counted); bad ones are skipped. Its episodes are
        trimmed to a multiple of the micro-batches. NoRollouts after timeout_s without one (the engine is gone)."""
        # one deadline for a batch to train on: dropping stale ones or skipping bad ones does not
        # restart it (an engine stuck on an old version made the trainer drop batches for ever)
        deadline = time.monotonic() + self.timeout_s
        dropped0 = len(self.dropped)
        while True:
            try:
                b = rl_task.read_batch(self.dir, self.next, version, self.max_tokens, self.vocab)
            except FileNotFoundError:
                b = None
            except rl_task.BadBatch as exc:
                self._advance()
                self._skip(str(exc))
                b = None
            if b is None:
                if time.monotonic() > deadline:
                    stale = len(self.dropped) - dropped0
                    raise NoRollouts(
                        f"no rollout batch to train on in {self.dir} for {self.timeout_s:.0f} s "
                        + (f"({stale} dropped as more than {self.k} versions old, the newest from version "
                           f"{self.dropped[-1]['version']}: is the rollout engine stuck on an old version?)"
                           if stale else f"(waiting for batch {self.next}: is the rollout engine gone?)")
                        + " (rl.rollout_timeout)") from None
                time.sleep(0.02)
                continue
            self._advance()
            path = rl_task.batch_path(self.dir, self.next - 1)
            # a group with a token sampled more than k versions ago goes whole (its baseline with it)
            groups: dict[int, int] = {}
            for e in b["episodes"]:
                groups[e["group"]] = min(groups.get(e["group"], e["version"]), e["version"])
            old = {g for g, v in groups.items() if version - v > self.k}
            if len(old) == len(groups):
                stale = version - b["version"]
                self.dropped.append({"batch": self.next - 1, "version": b["version"], "staleness": stale})
                print(f"rl: dropped rollout batch {self.next - 1}: generated by version {b['version']}, {stale} "
                      f"versions behind the trainer's {version} (max_staleness {self.k}); "
                      f"{len(self.dropped)} dropped so far", flush=True)
                continue
            if old:
                gone = [e for e in b["episodes"] if e["group"] in old]
                self.dropped_groups += len(old)
                self.dropped_episodes += len(gone)
                b["episodes"] = [e for e in b["episodes"] if e["group"] not in old]
                b["version"] = min(e["version"] for e in b["episodes"])
            stale = version - b["version"]
            eps, bad, why = b["episodes"], b["bad"], b["skipped"]
            keep = len(eps) - len(eps) % self.micro
            if keep == 0:
                self._skip(f"{path}: {len(eps)} good episode(s), fewer than the {self.micro} micro-batches"
                           + (f" ({why[0]}; {bad} bad)" if bad else ""))
                continue
            if bad or keep < len(eps):
                rl_task.warn(f"{path}: training on {keep} of {len(eps) + bad} episodes"
                             + (f"; skipped {bad} bad, the first: {why[0]}" if bad else "")
                             + (f"; {len(eps) - keep} left over from the {self.micro} micro-batches"
                                if keep < len(eps) else ""))
            b["episodes"] = eps[:keep]
            b["staleness"] = stale
            return b


STAT_KEYS = ("tokens", "with_mu", "ratio_sum", "ratio_sq", "ratio_max", "clipped", "same", "same_absdiff",
             "absdiff")


def tis_step(ddp, opt, t: dict, allowed: list[int], delta: float, policy_version: int) -> dict:
    """One optimizer step of the truncated importance-sampling policy gradient on rollouts of
    a behaviour policy mu (the engine's, maybe older): minimises
        -sum(sg(min(pi / mu, delta)) * A * log pi) / (tokens of the policy)
    over the policy's tokens (t: rl_task.tensors). pi is the trainer's policy normalised over
    the task's `allowed` tokens, as the engine's processed logprobs are under its restricted
    sampling (the same normalisation on both sides, or the ratio is off by the mass outside).
    A token without a behaviour logprob (versions -1) gets weight 1: plain policy gradient.
    Returns the loss and the ratio's statistics; "same_*": tokens the engine sampled with the
    very weights the trainer holds now (version == policy_version), whose |log pi - log mu| is
    the end-to-end check that the engine's forward uses the trainer's weights."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from nemo_dcr_callback.recipes.megatron_model import run_schedule

    tokens = t["tokens"]
    micro, batch, seq1 = tokens.shape
    seq = seq1 - 1
    n = max(int(t["mask"].sum()), 1)
    allowed_t = torch.tensor(allowed)
    data = iter([{k: x[i] for k, x in t.items()} for i in range(micro)])

    def forward_step(data_iterator, model):
        d = next(data_iterator)
        inp = d["tokens"][:, :-1].contiguous()
        labels = d["tokens"][:, 1:]
        pos = torch.arange(seq, device=inp.device).unsqueeze(0).expand(batch, -1)
        logits = model(inp, pos, None)  # [batch, seq, vocab / tp]: no labels, the logits

        def loss_func(output):
            full = gather_from_tensor_model_parallel_region(output).float()  # [batch, seq, vocab]
            logp_all = torch.log_softmax(full[..., allowed_t], dim=-1)
            mask = d["mask"] > 0
            idx = torch.where(mask, labels - allowed[0], 0).clamp(0, len(allowed) - 1)
            logp = logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mask
            has_mu = (d["versions"] >= 0) & mask
            with torch.no_grad():
                diff = torch.where(has_mu, logp - d["mu"], 0.0)
                ratio = torch.where(has_mu, diff.exp(), 0.0)
                w = torch.where(has_mu, ratio.clamp(max=delta), 1.0)
                same = has_mu & (d["versions"] == policy_version)
            loss = -(w * d["weights"] * logp).sum() * micro / n  # the schedule divides by micro
            stats = {"tokens": mask.sum(), "with_mu": has_mu.sum(), "ratio_sum": ratio.sum(),
                     "ratio_sq": (ratio * ratio).sum(), "ratio_max": ratio.max(), "clipped": (ratio > delta).sum(),
                     "same": same.sum(), "same_absdiff": torch.where(same, diff.abs(), 0.0).sum(),
                     "absdiff": diff.abs().sum()}
            return loss, {"loss": loss.detach(), **{k: v.detach().float() for k, v in stats.items()}}

        return logits, loss_func

    got: list[dict] = []
    loss = run_schedule(ddp, opt, forward_step, data, micro, seq, batch, collect=got)
    if not got:
        return {"loss": loss}
    tot = {k: float(sum(g[k] for g in got)) for k in STAT_KEYS if k != "ratio_max"}
    k_mu = max(tot["with_mu"], 1.0)
    mean = tot["ratio_sum"] / k_mu
    return {"loss": loss, "tokens": int(tot["tokens"]), "with_mu": int(tot["with_mu"]),
            "ratio_mean": mean, "ratio_std": max(tot["ratio_sq"] / k_mu - mean * mean, 0.0) ** 0.5,
            "ratio_max": max(float(g["ratio_max"]) for g in got), "clip_frac": tot["clipped"] / k_mu,
            "same_version_tokens": int(tot["same"]),
            "same_version_absdiff": tot["same_absdiff"] / tot["same"] if tot["same"] else None,
            "absdiff": tot["absdiff"] / k_mu if tot["with_mu"] else None}


def _module_class():
    from nemo_dcr_callback.recipes.lightning_gpt import MegatronGPTModule

    class RLGPTModule(MegatronGPTModule):
        """MegatronGPTModule trained on rollouts (see the module docstring)."""

        def __init__(self, *args, rollouts: str, max_staleness: int = 1, rollout_timeout: float = 300.0,
                     task: str = "search", delta: float = 2.0, warm_steps: int = 0, lr_after: float | None = None,
                     **kwargs):
            super().__init__(*args, **kwargs)
            self.warm_steps, self.lr_after = warm_steps, lr_after
            self.rollouts, self.max_staleness, self.rollout_timeout = rollouts, max_staleness, rollout_timeout
            self.task, self.delta = rl_task.TASKS[task], delta
            self.queue: RolloutQueue | None = None

        def train_dataloader(self):
            import torch

            steps = int(self.trainer.max_steps) if self.trainer.max_steps and self.trainer.max_steps > 0 else 10
            return torch.utils.data.DataLoader(list(range(steps)), batch_size=None, shuffle=False)

        def _policy_version(self) -> int:
            from nemo_dcr_callback.sender.callback import DCRCallback

            cbs = [c for c in self.trainer.callbacks if isinstance(c, DCRCallback)]
            return cbs[0].version if cbs else int(self.trainer.global_step)

        def training_step(self, batch, batch_idx):
            import torch.distributed as dist

            t0 = time.perf_counter()
            version = self._policy_version()
            box: list = [None]
            # (each rank is its own Lightning trainer under the single-device strategy: its
            # global_rank is 0 everywhere; Megatron's ranks are torch.distributed's)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == 0:
                if self.queue is None:
                    # an episode fills at most the batch's sequence, which the model's positions must cover
                    self.queue = RolloutQueue(self.rollouts, self.max_staleness, self.rollout_timeout, self.micro,
                                              min(self.task.seq, self.cfg.seq_length) + 1, self.cfg.vocab_size)
                try:
                    box[0] = self.queue.take(version)
                except NoRollouts as exc:
                    box[0] = {"error": str(exc)}
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(box, src=0)
            b = box[0]
            if "error" in b:
                raise NoRollouts(b["error"])
            waited = time.perf_counter() - t0
            if self.lr_after is not None and batch_idx == self.warm_steps:  # the small steps of real RL
                for g in self._opt.param_groups:
                    g["lr"] = self.lr_after
            episodes = [rl_task.Episode.from_json(e) for e in b["episodes"]]
            t = rl_task.tensors(episodes, self.micro, min(self.task.seq, self.cfg.seq_length))
            st = tis_step(self._ddp, self._opt, t, self.task.allowed, self.delta, version)
            if rank == 0:
                vs = [v for e in episodes for v in e.versions]
                rec = {"step": batch_idx + 1, "trained_on": b["version"], "staleness": b["staleness"],
                       "policy_version": version, "reward": sum(e.reward for e in episodes) / len(episodes),
                       "episodes": len(episodes), "dropped": len(self.queue.dropped),
                       "dropped_groups": self.queue.dropped_groups, "dropped_episodes": self.queue.dropped_episodes,
                       "skipped": len(self.queue.skipped), "bad_episodes": b["bad"], "wait_s": waited,
                       "token_staleness": {str(k): sum(1 for v in vs if version - v == k)
                                           for k in sorted({version - v for v in vs})},
                       "multi_version_episodes": sum(1 for e in episodes if len(set(e.versions)) > 1),
                       "turns": sum(len(e.mine) for e in episodes) / len(episodes),
                       "step_s": time.perf_counter() - t0, **st, "delta": self.delta,
                       "lr": self._opt.param_groups[0]["lr"], "time": time.time()}
                with rl_task.open_log(Path(self.rollouts) / STEP_LOG) as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"rl: step {batch_idx + 1} on version {b['version']} (staleness {b['staleness']}), "
                      f"mean reward {rec['reward']:.3f}", flush=True)
            return None

    return RLGPTModule


@hydra.main(config_path=CONFIGS, config_name="rl_gpt", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg, hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig, run_dir: str) -> None:
    from nemo_dcr_callback import launcher

    try:
        le = launcher.setup()
    except launcher.LaunchError as exc:
        raise SystemExit(f"nemo-dcr rl_train: {exc}") from None
    warnings.filterwarnings("ignore", module="megatron")
    import hydra.utils
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig
    from nemo_dcr_callback.recipes.stop import StopConfig, StopOnSignal, fit

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not cfg.rl.rollouts:
        raise SystemExit("nemo-dcr rl_train: set rl.rollouts (the folder the rollout worker writes)")
    if cfg.rl.task not in rl_task.TASKS:
        raise SystemExit(f"nemo-dcr rl_train: rl.task={cfg.rl.task} is none of {sorted(rl_task.TASKS)}")
    if not cfg.rl.delta >= 1.0:
        raise SystemExit(f"nemo-dcr rl_train: rl.delta={cfg.rl.delta}: the truncation must be at least 1")
    if cfg.model.seq_length < rl_task.TASKS[cfg.rl.task].seq:
        raise SystemExit(f"nemo-dcr rl_train: model.seq_length={cfg.model.seq_length} is shorter than the "
                         f"{cfg.rl.task} task's episodes ({rl_task.TASKS[cfg.rl.task].seq} tokens)")
    module = _module_class()(
        TinyGPTConfig(**OmegaConf.to_container(cfg.model)),
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size, lr=cfg.optimizer.lr,
        family=cfg.dcr.family, micro_batches=cfg.data.micro_batches, seed=cfg.trainer.seed,
        rollouts=cfg.rl.rollouts, max_staleness=cfg.rl.max_staleness, rollout_timeout=cfg.rl.rollout_timeout,
        task=cfg.rl.task, delta=cfg.rl.delta, warm_steps=cfg.rl.get("warm_steps", 0),
        lr_after=cfg.rl.get("lr_after", None))
    # the stop last: it ends the run after the step's callbacks (the DCR publish) have run
    stop = StopOnSignal(StopConfig(cfg.trainer.get("stop_grace_s", StopConfig.grace_s)))
    callbacks = [*(hydra.utils.instantiate(c) for c in cfg.trainer.callbacks), stop]
    device = torch.device("cuda", le.local_rank) if torch.cuda.is_available() else "cpu"
    trainer = L.Trainer(strategy=SingleDeviceStrategy(device=device), max_steps=cfg.trainer.max_steps, max_epochs=1,
                        callbacks=callbacks, default_root_dir=run_dir, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    fit(trainer, module, stop)


if __name__ == "__main__":
    main()
