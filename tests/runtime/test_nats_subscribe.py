"""subscribe_live returns only once the NATS server has the subscriptions, even over a slow link."""

import asyncio
import contextlib
from functools import partial
from urllib.parse import urlparse

import nats

from dynamo_pd.runtime.events_nats import subscribe_live

HOLD_S = 0.5


async def pipe(reader, writer, hold_from: bytes | None = None) -> None:
    """Copy bytes; from the first `hold_from` on each chunk, the rest waits HOLD_S (order kept)."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            cut = data.find(hold_from) if hold_from else -1
            if cut >= 0:
                writer.write(data[:cut])
                await writer.drain()
                await asyncio.sleep(HOLD_S)
                data = data[cut:]
            writer.write(data)
            await writer.drain()
    writer.close()


async def slow_sub_relay(server_port: int, client_reader, client_writer) -> None:
    """A link to the server on which every SUB (and what follows it) arrives late, a PING before it at once."""
    server_reader, server_writer = await asyncio.open_connection("127.0.0.1", server_port)
    await asyncio.gather(pipe(client_reader, server_writer, hold_from=b"SUB "),
                         pipe(server_reader, client_writer))


async def test_a_message_published_right_after_subscribe_live_arrives(nats_url):
    relay = await asyncio.start_server(partial(slow_sub_relay, urlparse(nats_url).port), "127.0.0.1", 0)
    relay_url = f"nats://127.0.0.1:{relay.sockets[0].getsockname()[1]}"
    subscriber, publisher = await nats.connect(relay_url), await nats.connect(nats_url)
    received: asyncio.Queue = asyncio.Queue()
    try:
        subs = await subscribe_live(subscriber, ["live.a", "live.b"], received.put, timeout=5)
        assert len(subs) == 2
        # a flush() alone would have returned already: its PING overtakes the held-back SUBs
        await publisher.publish("live.b", b"right away")
        await publisher.flush()
        msg = await asyncio.wait_for(received.get(), 5)
        assert (msg.subject, msg.data) == ("live.b", b"right away")
    finally:
        await subscriber.close()
        await publisher.close()
        relay.close()
