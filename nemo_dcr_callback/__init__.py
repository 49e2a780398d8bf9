"""nemo-dcr: delta-compressed refit of RL policies, from Megatron/NeMo trainers to rollout
workers, bit-exact. Data path (one module per stage, imports point down):
delta (kernel) -> codec (chunks) -> deltafile / transport -> receiver."""

__version__ = "0.1.0"
