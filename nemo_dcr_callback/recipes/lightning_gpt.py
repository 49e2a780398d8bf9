"""A LightningModule training a megatron-core GPT under manual optimization (the pipeline
schedule drives forward/backward; the Megatron optimizer steps). Used by scripts/train.py,
`make demo`-style runs and the callback tests. Parallelism is Megatron's own: run one
process per rank (torchrun / srun) and give Lightning a single-device strategy."""

from __future__ import annotations

import datetime
import io
import os
import shutil
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist

from nemo_dcr_callback import safe_io
from nemo_dcr_callback.recipes.megatron_model import (
    TinyGPTConfig,
    build_model,
    hf_config,
    train_step,
    wrap_for_training,
)

STEP_CLOCK_ENV = "NEMO_DCR_STEP_CLOCK"  # set: rank 0 prints each step's start (monotonic clock) and its peak memory
PEAK_MEMORY = "NEMO_DCR_PEAK_MEMORY"  # the line's first word: bytes, then what was measured


class RandomTokens(torch.utils.data.Dataset):
    """Synthetic token batches [micro_batches, micro_batch_size, seq + 1], per DP rank."""

    def __init__(self, steps: int, micro: int, batch: int, seq: int, vocab: int, seed: int):
        self.steps, self.shape, self.vocab, self.seed = steps, (micro, batch, seq + 1), vocab, seed

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        return torch.randint(0, self.vocab, self.shape, generator=g)


def init_distributed(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) from the launcher's environment, then
    Megatron's parallel state; the CPU shims where there is no GPU."""
    from megatron.core import parallel_state as ps

    if not torch.cuda.is_available():
        from nemo_dcr_callback.recipes import megatron_cpu

        megatron_cpu.enable()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


class MegatronGPTModule(L.LightningModule):
    def __init__(self, model: TinyGPTConfig, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, lr: float = 1e-4, micro_batches: int = 2,
                 micro_batch_size: int = 2, distributed_optimizer: bool = False, seed: int = 1234,
                 expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                 family: str = "llama", checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 min_step_s: float = 0.0):
        super().__init__()
        self.min_step_s = min_step_s
        self.checkpoints = StepCheckpoints(checkpoint_dir, checkpoint_every) if checkpoint_dir else None
        self.cfg = model
        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        self.ep, self.etp, self.family = expert_model_parallel_size, expert_tensor_parallel_size, family
        self.lr, self.micro, self.mbs = lr, micro_batches, micro_batch_size
        self.distributed_optimizer, self.seed = distributed_optimizer, seed
        self.automatic_optimization = False
        self.megatron = None
        self.dcr_vocab_size = model.vocab_size

    def configure_model(self) -> None:
        if self.megatron is not None:
            return
        init_distributed(self.tp, self.pp, self.ep, self.etp)
        self.megatron = build_model(self.cfg, seed=self.seed)
        if torch.cuda.is_available():  # as Megatron's get_model: on the GPU before DDP's buffers and the fp32 masters
            self.megatron.cuda(torch.cuda.current_device())
        if self.checkpoints is not None:  # before the optimizer copies the weights into its fp32 masters
            self.checkpoints.restore(self.megatron)
        self._ddp, self._opt = wrap_for_training(self.megatron, lr=self.lr,
                                                 distributed_optimizer=self.distributed_optimizer)

    def dcr_model(self):
        return self.megatron

    def dcr_hf_config(self):
        return hf_config(self.cfg, self.family)

    def configure_optimizers(self):
        return None  # the Megatron optimizer is stepped in training_step

    def train_dataloader(self):
        from megatron.core import parallel_state as ps

        steps = int(self.trainer.max_steps) if self.trainer.max_steps and self.trainer.max_steps > 0 else 10
        ds = RandomTokens(steps, self.micro, self.mbs, self.cfg.seq_length, self.cfg.vocab_size,
                          self.seed + ps.get_data_parallel_rank())
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False)

    def training_step(self, batch, batch_idx):
        # Wall time from one step's start to the next's: the step plus every callback's work.
        now = time.perf_counter()
        if self.min_step_s and getattr(self, "_t_last", None) is not None:  # paced like a slower model's steps
            time.sleep(max(0.0, self.min_step_s - (now - self._t_last)))
            now = time.perf_counter()
        if getattr(self, "_t_last", None) is not None:
            self.log("step_ms", 1e3 * (now - self._t_last), on_step=True, batch_size=1)
        self._t_last = now
        if os.environ.get(STEP_CLOCK_ENV) and self.trainer.global_rank == 0:  # bench overhead: when steps start
            # one write of the whole line: print's two (text, then newline) let another rank's line in between
            sys.stdout.write(f"{STEP_CLOCK_ENV} {batch_idx} {time.monotonic():.4f}\n")
            sys.stdout.flush()
        loss = train_step(self._ddp, self._opt, batch, self.cfg)
        if batch_idx == 0 and self.trainer.global_rank == 0:
            from nemo_dcr_callback.recipes.megatron_cpu import fp32_gemm_products

            if n := fp32_gemm_products():  # the CPU run mode took the model's products (megatron_cpu)
                print(f"cpu run mode: step 1 computed {n} bf16 matrix products in fp32 on rank 0", flush=True)
        if loss is not None:
            self.log("loss", loss, on_step=True, prog_bar=False, batch_size=1)
        return None

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.checkpoints is not None:
            self.checkpoints.step(self.megatron)

    def on_train_end(self) -> None:
        if not os.environ.get(STEP_CLOCK_ENV) or self.trainer.global_rank != 0:
            return
        if torch.cuda.is_available():  # the tensors' peak: the callback's baselines and buffers show here
            print(f"{PEAK_MEMORY} {torch.cuda.max_memory_allocated()} cuda_max_allocated", flush=True)
        else:
            import resource

            print(f"{PEAK_MEMORY} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024} host_max_rss",
                  flush=True)


class StepCheckpoints:
    """A training checkpoint every N steps: each rank's weights (its shards, BF16) and the step,
    in dir/step-NNNNNNNN/rank-R.pt; rank 0 marks a step complete once every rank wrote, and keeps
    the last two. A restarted job loads the newest complete one; the DCR callback then resumes
    from the store (rebased on its last committed version). The optimizer's moments are not
    kept: the weights and the step are what a restart must continue from here."""

    def __init__(self, path: str, every: int):
        self.dir, self.every, self.at = Path(path), every, 0

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def complete(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("step-*") if (p / "done").exists())

    def restore(self, model) -> None:
        done = self.complete()
        if not done:
            return
        state = torch.load(done[-1] / f"rank-{self._rank()}.pt", weights_only=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state["params"][n])
        self.at = int(state["step"])
        if self._rank() == 0:
            print(f"trainer: resumed from the checkpoint of step {self.at} ({done[-1]})", flush=True)

    def step(self, model) -> None:
        self.at += 1
        if not self.every or self.at % self.every:
            return
        d = self.dir / f"step-{self.at:08d}"
        d.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save({"step": self.at, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}, buf)
        # renamed into place: a rank killed mid-write leaves no torn file, and a link planted in
        # the checkpoint folder is never written through
        safe_io.write_whole(d / f"rank-{self._rank()}.pt", buf.getbuffer())
        if dist.is_initialized():
            dist.barrier()
        if self._rank() == 0:
            safe_io.write_whole(d / "done", b"")
            for old in self.complete()[:-2]:
                shutil.rmtree(old, ignore_errors=True)
