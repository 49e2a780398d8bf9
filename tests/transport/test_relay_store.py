"""The relay client (transport/relay_store.py: RelayStore's own HTTP/1.1 client): a kept-alive
connection the relay closed is replaced, chunked bodies are read whole, and a body cut short
or a reply that is not HTTP is a StoreError, never data."""

from __future__ import annotations

import threading

import pytest

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.relay_store import RelayStore
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.relay import (
    TOKEN,
)


def test_a_kept_alive_connection_the_relay_closed_is_replaced(tmp_path):
    """The client keeps one connection per thread. When the relay closes it meanwhile (here:
    the relay restarts on the same port), the next request goes over a new connection instead
    of failing (and is never sent twice). In-process relays; one client thread."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    origin.put("keyframe/0000000001/model.safetensors", b"first")
    client = ThreadPoolExecutor(1)

    async def main():
        run = asyncio.get_running_loop().run_in_executor
        relay = Relay(origin, RelayConfig(token=TOKEN, prefetch=False))
        await relay.start()
        store = RelayStore(f"relay://127.0.0.1:{relay.port}", token=TOKEN)
        got = [await run(client, store.get, "keyframe/0000000001/model.safetensors")]
        port = relay.port
        await relay.stop()
        origin.put("keyframe/0000000002/model.safetensors", b"second")
        relay = Relay(origin, RelayConfig(token=TOKEN, port=port, prefetch=False))
        await relay.start()
        try:
            got.append(await run(client, store.get, "keyframe/0000000002/model.safetensors"))
        finally:
            await relay.stop()
        return got

    assert asyncio.run(main()) == [b"first", b"second"]


def test_the_relay_client_reads_chunked_bodies_and_refuses_cut_ones():
    """RelayStore's own HTTP/1.1 client (http.client parsed headers with the email package,
    most of a small request's CPU): a chunked body is read whole; a body cut short of its
    Content-Length, or a reply that is not HTTP, is a StoreError naming it, never data. A raw
    TCP server plays the relay's replies (no relay sends these on purpose)."""
    import socket

    body = b'["versions/0000000001/VERSION.json"]'
    replies = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:7], body[7:])) + b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + body[:10],
        b"SSH-2.0-OpenSSH_9.6\r\n",
    ]
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        for reply in replies:
            c, _ = srv.accept()
            c.recv(65536)
            c.sendall(reply)
            c.close()  # (each reply on a connection of its own)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    store = RelayStore(f"relay://127.0.0.1:{srv.getsockname()[1]}", token=TOKEN)
    assert store.list("versions") == ["versions/0000000001/VERSION.json"]
    store._local.conn = None
    with pytest.raises(StoreError, match="ended after 10 of 100 bytes"):
        store.list("versions")
    with pytest.raises(StoreError, match="not an HTTP response"):
        store.list("versions")
    srv.close()
