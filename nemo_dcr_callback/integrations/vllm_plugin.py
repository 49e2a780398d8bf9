"""The `vllm.general_plugins` entry point (pyproject.toml): vLLM runs `register` in each of its
processes, so `{"backend": "dcr"}` selects integrations/vllm_transfer.py with no other code."""

from __future__ import annotations


def register() -> None:
    """Register the `dcr` engine and trainer backends (lazily: their module loads when one is
    built) and install the CPU weight-keeping hooks before any model loads (they act only in
    engines that follow a DCR store)."""
    # vllm exists only in the processes that call this; integrations/vllm.py installs the hooks
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from nemo_dcr_callback.integrations.vllm import BACKEND

    module = "nemo_dcr_callback.integrations.vllm_transfer"
    for factory, cls in ((WeightTransferEngineFactory, "DCRWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "DCRTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:  # registered already (plugins may load more than once in a process)
            pass
