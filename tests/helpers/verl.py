"""verl's weight sync without Ray, for tests/integrations/verl (imports verl: .venv-verl).

`VerlJob` holds verl's own worker classes (ActorRolloutRefWorker on the trainer side,
CheckpointEngineWorker on the rollout side), built the way verl builds their engines: the
checkpoint-engine config composed by Hydra from verl's ppo_trainer.yaml with the overrides the
engine's docstring gives, `custom_backend_module` imported by verl's import_external_libs, the
engine made by CheckpointEngineRegistry.new with verl's arguments. `sync(global_steps)` is
CheckpointEngineManager.update_weights (base.py) step for step, with direct calls where it
has Ray calls: prepare on every worker, the backend's build_topology, init_process_group,
then the actor's and the rollout workers' update_weights at once (verl's own methods), then
finalize. As verl's CPU tests do (tests/checkpoint_engine/test_global_steps_on_cpu.py), the
workers are made without their Ray constructors and their methods are called unwrapped.

The actor's training engine is a tiny Hugging Face Qwen2 in BF16 whose `step` changes a few
percent of its elements like an optimizer step; the rollout's server adapter stands in for
the inference engine: it copies what receive_weights yields into its own weights.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import torch
import transformers
import verl
from hydra import compose, initialize_config_dir
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.utils import ensure_async_iterator

MODULE = "nemo_dcr_callback.integrations.verl"
CE = "actor_rollout_ref.rollout.checkpoint_engine"


def engine_config(store: str, **engine_kwargs):
    """verl's CheckpointEngineConfig for `dcr`, composed from verl's own trainer config with the
    overrides of the engine's docstring (plus any other engine_kwargs)."""
    overrides = [f"{CE}.backend=dcr", f"{CE}.custom_backend_module={MODULE}", f"+{CE}.engine_kwargs.dcr.store={store}"]
    overrides += [f"+{CE}.engine_kwargs.dcr.{k}={v}" for k, v in engine_kwargs.items()]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)


class TrainingEngine:
    """The actor's model engine: get_per_tensor_param() as verl's engines give it (a generator
    of Hugging Face names and dense tensors, and no PEFT config)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.gen = torch.Generator().manual_seed(1)

    def get_per_tensor_param(self, **_):
        return ((n, t.detach()) for n, t in self.model.state_dict().items()), None

    @torch.no_grad()
    def step(self, rate: float = 0.03, skip: tuple[str, ...] = ()) -> None:
        """An optimizer-like step: about `rate` of each tensor's elements move by a small
        relative amount (tensors whose name contains any of `skip` stay as they are)."""
        for n, p in self.model.state_dict().items():
            if any(s in n for s in skip):
                continue
            mask = torch.rand(p.shape, generator=self.gen) < rate
            step = torch.randn(p.shape, generator=self.gen).to(p.dtype) * 0.02 * (p.abs() + 1e-3)
            p.add_(torch.where(mask, step, torch.zeros_like(p)))

    def bits(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().view(torch.int16).clone() for n, t in self.model.state_dict().items()}


class ServerAdapter:
    """The rollout's inference engine: keeps its own copy of every tensor it is given."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}
        self.names: list[str] = []  # what the last update carried
        self.global_steps = None

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **_):
        assert wire_format == "named_tensors"
        self.names, self.global_steps = [], global_steps
        async for name, t in ensure_async_iterator(weights):
            self.names.append(name)
            self.weights[name] = t.detach().clone()

    def bits(self) -> dict[str, torch.Tensor]:
        return {n: t.view(torch.int16) for n, t in self.weights.items()}


class VerlJob:
    """An actor worker group and rollout workers, their engines built as verl builds them."""

    def __init__(self, config, model: torch.nn.Module, actors: int = 1, rollouts: int = 2, rollout_config=None):
        """rollout_config: the rollout workers' config, where it differs (a store path that is
        another folder on the rollout's machines)."""
        self.config = config
        backend = config.backend
        bucket_size = config.update_weights_bucket_megabytes << 20
        engine_kwargs = config.engine_kwargs.get(backend, {})
        import_external_libs(config.custom_backend_module or None)  # as each worker does
        self.engine = TrainingEngine(model)
        self.actors = []
        for rank in range(actors):  # ActorRolloutRefWorker.init_model, "4. build checkpoint engine"
            w = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
            w.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=config))
            w.actor = SimpleNamespace(engine=self.engine)
            w.checkpoint_engine = CheckpointEngineRegistry.new(backend, is_master=(rank == 0),
                                                               bucket_size=bucket_size, **engine_kwargs)
            self.actors.append(w)
        rollout_kwargs = (rollout_config or config).engine_kwargs.get(backend, {})
        self.rollouts = []
        for _ in range(rollouts):  # CheckpointEngineWorker.__init__
            w = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
            w.checkpoint_engine = CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **rollout_kwargs)
            w.server_adapter = ServerAdapter()
            self.rollouts.append(w)
        self.metrics: list[dict] = []
        self.errors: dict[str, list[BaseException]] = {}  # the last sync's, by side

    def adapters(self) -> list[ServerAdapter]:
        return [w.server_adapter for w in self.rollouts]

    def _execute(self, workers, method: str, kwargs: dict | None = None) -> list:
        cls = type(workers[0]) if workers else None
        return [cls.execute_checkpoint_engine.__wrapped__(w, method, **{k: v[i] for k, v in (kwargs or {}).items()})
                for i, w in enumerate(workers)]

    def sync(self, global_steps: int | None, during=None) -> None:
        """CheckpointEngineManager.update_weights without Ray (no replicas to abort or resume:
        its steps 1, 3, 7 and 8 concern the inference servers). `during`: a coroutine run
        alongside the send, before the rollout workers start receiving. The first error of a
        worker is raised, after every worker finished, as ray.get would."""
        backend_cls = CheckpointEngineRegistry.get(self.config.backend)
        metadata = self._execute(self.actors, "prepare") + self._execute(self.rollouts, "prepare")
        actor_kwargs, rollout_kwargs = backend_cls.build_topology(len(self.actors), len(self.rollouts), metadata)
        self._execute(self.actors, "init_process_group", actor_kwargs)
        self._execute(self.rollouts, "init_process_group", rollout_kwargs)

        async def receive_all():
            if during is not None:
                await during
            receive = CheckpointEngineWorker.update_weights.__wrapped__
            return await asyncio.gather(*[receive(w, global_steps=global_steps) for w in self.rollouts],
                                        return_exceptions=True)

        async def run():
            sends = [ActorRolloutRefWorker.update_weights.__wrapped__(w, global_steps=global_steps, mode="auto")
                     for w in self.actors]
            return await asyncio.gather(*sends, receive_all(), return_exceptions=True)

        *sent, received = asyncio.run(run())
        self._execute(self.actors, "finalize")
        self._execute(self.rollouts, "finalize")
        received = received if isinstance(received, list) else [received]
        self.errors = {side: [r for r in results if isinstance(r, BaseException)]
                       for side, results in (("actor", sent), ("rollout", received))}
        self.metrics.append(sent[0] if isinstance(sent[0], dict) else {})
        if self.errors["actor"] or self.errors["rollout"]:
            raise (self.errors["actor"] + self.errors["rollout"])[0]
