"""What a relay and its clients (transport.relay_store) both speak: header names, the object
route, the token's variable. Kept apart from the server so a receiver using the client never
imports aiohttp."""

from __future__ import annotations

CHECKSUM_HEADER = "X-DCR-XXH3"  # xxh3-64 (hex) of the object's bytes, on GET and HEAD answers
LENGTH_HEADER = "X-DCR-Length"  # the object's size, on HEAD answers (which carry no body)
OBJECT_ROUTE = "/o/"  # objects are GET/HEAD/PUT /o/{key}; PUT ?if_absent=1 is If-None-Match
TOKEN_ENV = "NEMO_DCR_RELAY_TOKEN"  # the shared token (Authorization: Bearer), by default
