"""nemo-dcr: delta-compressed refit of RL policies, from Megatron/NeMo trainers to rollout
workers, bit-exact. Data path (one module per stage, imports point down):
delta (kernel) -> codec (chunks) -> deltafile / transport -> receiver."""

__version__ = "0.1.0"


def __getattr__(name):  # DCRCallback without importing lightning for every CLI call
    if name == "DCRCallback":
        from nemo_dcr_callback.sender.callback import DCRCallback

        return DCRCallback
    raise AttributeError(name)
