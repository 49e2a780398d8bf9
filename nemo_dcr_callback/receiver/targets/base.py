"""What a Follower asks of a target (where verified chunks land)."""

from __future__ import annotations

from typing import Protocol

from nemo_dcr_callback import codec


class Target(Protocol):
    """Every target checks chunks before anything is applied and applies them in place.

    Optional, found by the Follower with hasattr: `flat(name)` (a flat view of a tensor: the
    digests, the journal and early apply read and write through it), `apply_with_terms`
    (the apply fused with the digest terms: per tensor, of the touched elements, before and
    after), `digest_of(name)` (a tensor's digest where flat views do not exist, None if the
    target holds it only in part) and `version` (a target that journals itself: its apply
    takes the version, and it says which version it holds).
    """

    def check(self, h: codec.ChunkHeader) -> None:
        """Refuse (codec.ChunkError) a chunk this target cannot take: unknown tensor, wrong shape."""

    def apply(self, decoded: list[codec.DecodedChunk]) -> None:
        """Apply verified, decoded chunks in place."""

    def names(self) -> list[str]:
        """The canonical tensor names this target holds."""

