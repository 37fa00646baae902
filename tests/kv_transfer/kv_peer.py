"""A real KV transfer agent in a separate process, driven over a multiprocessing pipe.

The peer's cache has deterministic random contents (seeded), so the test process can rebuild the
expected token stream of any blocks without asking for it.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import msgspec
import torch

from kv_transfer import KVLayout, KVMemory, KVTransferAgent, TransferConfig, TransferDescriptor
from kv_transfer.protocol import Begin

LAYERS, HEADS, HEAD_DIM, BLOCKS = 4, 4, 16, 64


def make_config(kind: str, name: str, ipc_dir=None, etcd_url: str = "", **overrides) -> TransferConfig:
    """The agent config of a test transport kind: zmq-tcp, zmq-ipc, nixl, nixl-etcd or inproc."""
    if kind == "zmq-tcp":
        return TransferConfig("zmq", **overrides)
    if kind == "zmq-ipc":
        return TransferConfig("zmq", endpoint=f"ipc://{ipc_dir}/{name}.sock", **overrides)
    if kind == "nixl-etcd":
        return TransferConfig("nixl", metadata_store=etcd_url, **overrides)
    return TransferConfig(kind, **overrides)


def make_layout(engine: str, block_size: int, num_kv_heads: int = HEADS, head_offset: int = 0,
                model: str = "smol") -> KVLayout:
    return KVLayout.for_engine(
        engine, model=model, num_layers=LAYERS, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
        block_size=block_size, num_blocks=BLOCKS, dtype="float32", total_kv_heads=HEADS, head_offset=head_offset,
    )


def filled_memory(layout: KVLayout, seed: int) -> KVMemory:
    memory = KVMemory.allocate(layout)
    generator = torch.Generator().manual_seed(seed)
    for buf in memory.buffers:
        buf.copy_(torch.randn(buf.shape, generator=generator))
    return memory


def token_stream(memory: KVMemory, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """[L, 2, num_tokens, H, D] held by `block_ids` of `memory`, in the logical order."""
    layers = [memory.layer_view(layer)[:, block_ids] for layer in range(memory.layout.num_layers)]
    stacked = torch.stack(layers)
    lay = memory.layout
    return stacked.reshape(lay.num_layers, 2, -1, lay.num_kv_heads, lay.head_dim)[:, :, :num_tokens]


def _serve(conn, config: TransferConfig, layout: KVLayout, seed: int) -> None:
    asyncio.run(_serve_async(conn, config, layout, seed))


async def _serve_async(conn, config: TransferConfig, layout: KVLayout, seed: int) -> None:
    memory = filled_memory(layout, seed)
    releases: list[tuple[str, str]] = []
    payloads: dict[str, bytes] = {}  # what each release's Finish carried
    async with KVTransferAgent(f"peer-{os.getpid()}", memory, config) as agent:
        conn.send(agent.endpoint)
        while True:
            command, *args = await asyncio.to_thread(conn.recv)
            try:
                if command == "hold":
                    rid, block_ids, num_tokens, kwargs = args
                    desc = agent.hold(
                        rid,
                        block_ids,
                        num_tokens,
                        lambda r, why, payload: (releases.append((r, why.value)), payloads.update({r: payload})),
                        **kwargs,
                    )
                    result = msgspec.msgpack.encode(desc)
                elif command == "pull":
                    desc = msgspec.msgpack.decode(args[0], type=TransferDescriptor)
                    result = await agent.pull(desc, args[1], skip_prefix_blocks=args[2])
                elif command == "reserve":  # push mode: tell the prefill side where to write
                    endpoint, encoded = args
                    result = await agent.reserve(endpoint, msgspec.msgpack.decode(encoded, type=TransferDescriptor))
                elif command == "payload":
                    result = payloads.get(args[0])
                elif command == "begin_then_hang":  # a decode that dies right after pinning
                    desc = msgspec.msgpack.decode(args[0], type=TransferDescriptor)
                    await agent._client.call(desc.endpoint, Begin(desc.request_id, desc.compat_hash, 1.0), 5.0)
                    result = "pinned"
                elif command == "tokens":
                    result = token_stream(memory, *args)
                elif command == "releases":
                    result = list(releases)
                elif command == "release":
                    result = agent.release(args[0])
                elif command == "holding":
                    result = agent.holding()
                elif command == "exit":
                    conn.send("bye")
                    return
                else:
                    result = ValueError(f"unknown command {command}")
            except Exception as e:  # hand the error to the test
                result = e
            conn.send(result)


class Peer:
    """Handle on a peer process; `call` sends one command and returns its answer."""

    def __init__(self, config: TransferConfig, layout: KVLayout, seed: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, config, layout, seed), daemon=True)
        self.process.start()
        self.endpoint = self.recv(60)

    def recv(self, timeout: float = 30):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer process silent for {timeout}s")
        result = self.conn.recv()
        if isinstance(result, Exception):
            raise result
        return result

    def call(self, *command, timeout: float = 30):
        self.conn.send(command)
        return self.recv(timeout)

    def hold(self, rid: str, block_ids: list[int], num_tokens: int, **kwargs) -> TransferDescriptor:
        return msgspec.msgpack.decode(self.call("hold", rid, block_ids, num_tokens, kwargs), type=TransferDescriptor)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=10)
            except (TimeoutError, OSError, EOFError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
