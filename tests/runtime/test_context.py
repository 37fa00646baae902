"""RequestContext.until_cancelled: how the vLLM, SGLang and TensorRT-LLM engines read their streams."""

from __future__ import annotations

import asyncio
import contextlib

from dynamo_pd.runtime import RequestContext


class Stream:
    """An engine's output stream: items from a queue, and a record of how its generator ended."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.ended: str | None = None
        self.gen = self._run()

    async def _run(self):
        try:
            while (item := await self.queue.get()) is not None:
                yield item
            self.ended = "done"
        except asyncio.CancelledError:
            self.ended = "step cancelled"  # what vLLM aborts a request on
            raise
        except GeneratorExit:
            self.ended = "closed"
            raise


async def test_items_pass_through_until_the_stream_ends():
    stream, context = Stream(), RequestContext("r")
    for item in (1, 2, 3, None):
        stream.queue.put_nowait(item)
    async with contextlib.aclosing(context.until_cancelled(stream.gen)) as outs:
        assert [out async for out in outs] == [1, 2, 3]
    assert stream.ended == "done"


async def test_a_cancel_while_a_step_waits_cancels_the_step_then_gives_none_and_the_stream_can_close():
    stream, context = Stream(), RequestContext("r")
    stream.queue.put_nowait(7)
    outs = context.until_cancelled(stream.gen)
    assert await anext(outs) == 7
    waiting = asyncio.ensure_future(anext(outs))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the step waits on the engine
    context.cancel()
    assert await asyncio.wait_for(waiting, 5) is None
    assert stream.ended == "step cancelled"  # before the engine hears of the cancel
    assert [out async for out in outs] == []  # nothing after the None
    await stream.gen.aclose()  # would raise if a step still ran the generator


async def test_closing_early_leaves_no_task_behind():
    stream, context = Stream(), RequestContext("r")
    stream.queue.put_nowait(1)
    before = asyncio.all_tasks()
    async with contextlib.aclosing(context.until_cancelled(stream.gen)) as outs:
        async for out in outs:
            assert out == 1
            break  # the consumer leaves after one item, as an engine does at its final output
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before
    await stream.gen.aclose()
    assert stream.ended == "closed"


async def test_a_cancel_already_set_gives_none_before_any_item_is_awaited_forever():
    stream, context = Stream(), RequestContext("r")
    context.cancel()
    async with contextlib.aclosing(context.until_cancelled(stream.gen)) as outs:
        assert [out async for out in outs] == [None]


async def test_on_cancel_calls_back_once_at_the_cancel_or_at_once_and_can_be_forgotten():
    from dynamo_pd.runtime.inbox import Inbox

    context, calls = RequestContext("r"), []
    forget = context.on_cancel(lambda: calls.append("first"))
    forget_second = context.on_cancel(lambda: calls.append("second"))
    forget_second()
    inbox = Inbox()
    waiting = asyncio.ensure_future(inbox.wait(10.0))
    context.on_cancel(inbox.wake)
    await asyncio.sleep(0)
    context.cancel()
    context.cancel()
    assert calls == ["first"] and await asyncio.wait_for(waiting, 1.0) is True and not inbox.items
    forget()
    context.on_cancel(lambda: calls.append("late"))  # already cancelled: called at once
    assert calls == ["first", "late"]
