"""Receivers: apply published versions to a live model or a checkpoint, verified first."""

from nemo_dcr_callback.receiver.follow import Follower, fetch_version

__all__ = ["Follower", "fetch_version"]
