"""How one relay node runs: RelayConfig (most fields are `nemo-dcr relay` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_dcr_callback import faults
from nemo_dcr_callback.protocol.records import RECEIVER_RECORD_MAX

# A relay that held a sender's write within this long counts as written through (its watcher
# then lists the parent only every write_through_poll_s): a trainer's steps, and so its
# versions, come seconds apart, and between them the relay polled the origin 25 times a second.
WRITE_THROUGH_S = 30.0


@dataclass
class RelayConfig:
    """How one relay node runs (docs/RELAY.md)."""

    host: str = "127.0.0.1"  # the address to listen on
    port: int = 0  # 0: a free port (printed on start)
    token: str | None = None  # the publisher's token (may write anything); None: no authentication (loopback trials)
    # receivers' token: read everything, write only registrations and acks (docs/SECURITY.md)
    receiver_token: str | None = None
    name: str = "relay"  # this node's name: in its stats, access log and start line
    cache_mb: int = 1024  # memory for cached objects; beyond it, LRU objects spill to disk
    spill_dir: str | None = None  # None: evicted objects are dropped (and refetched if asked again)
    spill_mb: int = 8192  # the spill directory's budget; beyond it, the oldest spilled objects go
    poll_s: float = 0.005  # how often the watcher lists the parent; also the TTL of cached listings
    idle_poll_s: float = 0.04  # the watcher's longest pause after rounds that found nothing new
    # ... while senders write through this relay (an immutable object within the last
    # WRITE_THROUGH_S): their objects arrive here directly, and listing the parent only catches
    # writes that went around the relay (a sender's failover), so it is listed this rarely. On
    # S3 a listing costs the relay 1.5-5 ms of CPU (boto3 parses XML); at 0.25 s the bench's
    # root relay listed S3 5-6 times per version.
    write_through_poll_s: float = 1.0
    # ... and once nothing new has turned up in the parent or been written through this relay
    # for dormant_after_s (no training running, or steps minutes apart): an idle root relay
    # listed S3 25 times a second (3.5% of a core here, 6% in SeaweedFS; on AWS, LIST requests
    # are billed). A version that then starts around the relay is seen up to this much later.
    dormant_after_s: float = 60.0
    dormant_poll_s: float = 1.0
    # a mutable object (an ack, a registration) written through this relay is served from here
    # for this long: the committer reads each ack right after it is written and every
    # registration at each version, and those reads then need no round trip to the origin (on
    # S3: 24 GETs per version at the root relay of the relay bench). What the relay passed up is
    # what the origin holds unless the same key was written around the relay since (a
    # failover), which shows after at most this: acks are written once per receiver and
    # version, and registrations, rewritten by their receiver every 30 s, are read for
    # membership and liveness (600 s), which a copy this old does not change.
    passed_ttl_s: float = 60.0
    prefetch: bool = True  # pull new versions ahead of requests
    threads: int = 16  # concurrent upstream requests
    lanes: int = 2  # parts pulled at once by the watcher (in order: the first ones arrive first)
    tls_cert: str | None = None  # serve HTTPS (relays://) with this certificate chain ...
    tls_key: str | None = None  # ... and this key; None: plain HTTP
    # Limits against a peer that opens connections and never finishes a request (docs/SECURITY.md):
    header_timeout_s: float = 15.0  # a connection without a complete request for this long is closed
    body_timeout_s: float = 120.0  # a request body not complete within this is refused (408)
    max_connections_per_peer: int = 256  # per client address; more are closed at once
    max_connections: int = 8192  # in all (the process's file descriptors are the hard limit)
    # Request bodies are read into one buffer each (that buffer is then verified, passed up and
    # cached, never copied): these bound what uploads can take, by size and in all.
    max_uploads: int = 4  # request bodies read at once, of the publisher's token
    upload_mb: int = 2048  # bytes of request bodies being read at once, of the publisher's token
    # Receivers' registrations and acks have slots of their own, so that slow ones (a
    # receivers'-token holder trickling bodies) never hold the publisher's parts and records up;
    # a peer takes at most a few at once, and a record's body must come within a short time.
    max_record_uploads: int = 64  # receivers' record bodies read at once, in all
    max_record_uploads_per_peer: int = 16  # ... from one address (more get 429)
    record_body_timeout_s: float = 10.0  # a registration's or ack's body not complete within this: 408
    max_record_bytes: int = RECEIVER_RECORD_MAX  # a registration or an ack: what readers take
    max_json_bytes: int = 64 << 20  # a rank manifest, version record, decision, keyframe record, stats
    max_object_mb: int = 1024  # a part, a keyframe's or verify's model.safetensors

    def max_bytes(self, kind: str) -> int:
        """The largest body a PUT of this kind of key (protocol.keys.kind) may have."""
        if kind in ("registration", "ack"):
            return self.max_record_bytes
        if kind in ("part", "keyframe_model", "verify_model"):
            return self.max_object_mb << 20
        return self.max_json_bytes
    fault: str | None = field(default_factory=faults.relay_fault)  # tests only (faults.py)
    # a file getting one JSON line per request served and per call to the parent (None: off):
    # what was asked, answered and fetched, and when, to trace a refusal back to its cause
    access_log: str | None = None
