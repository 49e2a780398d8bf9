"""Train a megatron-core GPT with Lightning and the DCR callback (a Hydra app).

One process per rank: `torchrun --nproc-per-node N -m nemo_dcr_callback.recipes.train
[overrides]` (scripts/train.py is the same entry point as a file), `mpirun -n N python
scripts/train.py`, `srun python scripts/train.py`, or scripts/launch_torchrun.sh /
scripts/train.sbatch / scripts/train_srun.sbatch. gloo on CPU, NCCL on GPU. Overrides, e.g.
  parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=2
  model.num_layers=8 model.hidden_size=512 trainer.max_steps=20 optimizer.lr=1e-5
  dcr.store=file:///shared/dcr dcr.verify=true hydra.run.dir=runs/exp1
A mixture of experts: megatron-core's names, e.g.
  model.num_moe_experts=8 model.moe_router_topk=2 model.moe_ffn_hidden_size=256
  parallel.expert_model_parallel_size=2 dcr.family=qwen3_moe
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

# The YAMLs ship inside the package (the top-level configs/ links to them), so a wheel install
# finds them too; an absolute path keeps Hydra from resolving it against the caller's file.
CONFIGS = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(config_path=CONFIGS, config_name="train_gpt", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg, hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig, run_dir: str) -> None:
    """One rank's training, under whichever launcher started it (launcher.py: torchrun,
    mpirun, srun); a composed config runs here without Hydra's command line (tests/mpi)."""
    from nemo_dcr_callback import launcher

    try:
        le = launcher.setup()  # torchrun's variables, whoever launched us: env:// reads those
    except launcher.LaunchError as exc:  # before any process group waits on a rank that never comes
        raise SystemExit(f"nemo-dcr train: {exc}") from None
    warnings.filterwarnings("ignore", module="megatron")
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from nemo_dcr_callback.recipes.lightning_gpt import MegatronGPTModule
    from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig
    from nemo_dcr_callback.recipes.stop import StopConfig, StopOnSignal, fit

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    module = MegatronGPTModule(
        TinyGPTConfig(**OmegaConf.to_container(cfg.model)),
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        distributed_optimizer=cfg.parallel.distributed_optimizer, lr=cfg.optimizer.lr,
        expert_model_parallel_size=cfg.parallel.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=cfg.parallel.get("expert_tensor_parallel_size"), family=cfg.dcr.family,
        micro_batches=cfg.data.micro_batches, micro_batch_size=cfg.data.micro_batch_size, seed=cfg.trainer.seed,
        checkpoint_dir=cfg.trainer.get("checkpoint_dir"), checkpoint_every=cfg.trainer.get("checkpoint_every", 0),
        min_step_s=cfg.trainer.get("min_step_s", 0.0))
    # the stop last: it ends the run after the step's callbacks (the DCR publish) have run
    stop = StopOnSignal(StopConfig(cfg.trainer.get("stop_grace_s", StopConfig.grace_s)))
    callbacks = [*(hydra.utils.instantiate(c) for c in cfg.trainer.callbacks), stop]
    device = torch.device("cuda", le.local_rank) if torch.cuda.is_available() else "cpu"
    trainer_cls = L.Trainer
    if cfg.trainer.get("cls", "lightning") == "nemo":  # NeMo 2's trainer (pip install nemo-dcr-callback[nemo])
        from nemo import lightning as nl

        trainer_cls = nl.Trainer
    elif cfg.trainer.get("cls", "lightning") != "lightning":
        raise SystemExit(f"trainer.cls must be lightning or nemo, not {cfg.trainer.cls!r}")
    trainer = trainer_cls(strategy=SingleDeviceStrategy(device=device), max_steps=cfg.trainer.max_steps,
                          max_epochs=1, callbacks=callbacks, default_root_dir=run_dir,
                          logger=CSVLogger(run_dir, name="logs") if le.rank == 0 else False,
                          enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    if le.rank == 0:
        print(f"trainer: {type(trainer).__module__}.{type(trainer).__qualname__} "
              f"(launcher: {le.launcher}, {le.world_size} ranks)", flush=True)
    fit(trainer, module, stop)


if __name__ == "__main__":
    main()
