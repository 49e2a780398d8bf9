"""Receivers: apply published versions to a live model or a checkpoint, verified first."""

from nemo_dcr_callback.receiver.follow import Follower

__all__ = ["Follower"]
