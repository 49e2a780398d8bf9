"""nemo-dcr: delta-compressed refit of RL policies, from Megatron/NeMo trainers to rollout
workers, bit-exact. Data path (docs/ARCHITECTURE.md), sender side down, receiver side up:
core.delta (the kernel) -> placement (canonical coordinates) -> codec (chunks) ->
protocol.upload -> transport (store or relay) -> protocol.commit (the joint commit) ->
receiver (verify, apply). Sender and receiver meet only in protocol/."""

__version__ = "0.1.0"


def __getattr__(name):  # DCRCallback without importing lightning for every CLI call
    if name == "DCRCallback":
        from nemo_dcr_callback.sender.callback import DCRCallback  # start-up cost: lightning, for every CLI call

        return DCRCallback
    raise AttributeError(name)
