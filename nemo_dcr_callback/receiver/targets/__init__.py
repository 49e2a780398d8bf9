"""Receiver targets: where verified chunks land (the interface: base.Target).

- `StateDictTarget` (state_dict.py): canonical tensors by name, e.g. a Hugging Face model's
  state_dict(); `apply_chunks` applies raw chunks to such a dict.
- `LoaderTarget` (loader.py): a live model whose own loader places the weights.
- `CheckpointDirTarget` (checkpoint_dir.py): a checkpoint directory patched in place, crash-safe.
"""

from nemo_dcr_callback.receiver.targets.base import Target
from nemo_dcr_callback.receiver.targets.checkpoint_dir import CheckpointDirTarget
from nemo_dcr_callback.receiver.targets.loader import LoaderTarget, LoadFn
from nemo_dcr_callback.receiver.targets.state_dict import StateDictTarget, apply_chunks

__all__ = ["CheckpointDirTarget", "LoadFn", "LoaderTarget", "StateDictTarget", "Target", "apply_chunks"]
