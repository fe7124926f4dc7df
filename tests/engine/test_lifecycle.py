"""Request lifecycles on the engine thread (tiny random Llama): a dead engine thread fails every caller
at once, an abandoned request is aborted whatever state it is in, and a remote prefill's handover
respects max_num_seqs."""
import asyncio
import contextlib
import threading

import pytest

from tandem.worker.engine.async_engine import AsyncEngine, EngineDead
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.engine.sequence import SamplingParams

PARAMS = SamplingParams.parse({"temperature": 0, "max_tokens": 8, "ignore_eos": True})


def test_engine_thread_death_fails_pending_calls(tiny_llama):
    """Fault injection (the engine's step is replaced by one that raises): a call queued while the
    step runs must fail with EngineDead, not wait forever."""
    async def main():
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4))
        release = threading.Event()

        def failing_step():
            release.wait(10)
            raise RuntimeError("injected step failure")
        engine.step = failing_step
        ae = AsyncEngine(engine)
        ae.start()
        gen = ae.generate("r1", [1, 2, 3], PARAMS)
        first = asyncio.ensure_future(gen.__anext__())       # adds the request: the step starts
        await asyncio.sleep(0.3)
        pending = asyncio.ensure_future(ae.call(lambda: "never"))   # queued behind the failing step
        await asyncio.sleep(0.1)
        release.set()
        with pytest.raises(EngineDead):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(EngineDead):
            await asyncio.wait_for(first, 5)
        with pytest.raises(EngineDead):
            await ae.call(lambda: "after")
        await gen.aclose()
    asyncio.run(main())


def test_cancel_while_adding_still_aborts(tiny_llama):
    """A caller cancelled while its add waits behind a long step (a client gone while queued): the add
    still runs on the engine thread, and the abort queued after it frees everything."""
    async def main():
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, max_num_batched_tokens=8))
        ae = AsyncEngine(engine)
        ae.start()
        busy = threading.Event()
        step = engine.step

        def slow_step():
            busy.set()
            out = step()
            threading.Event().wait(0.05)
            return out
        engine.step = slow_step   # fault injection: steps long enough to cancel inside one
        long = ae.generate("long", list(range(1, 300)), PARAMS)
        first = asyncio.ensure_future(long.__anext__())
        while not busy.is_set():
            await asyncio.sleep(0.01)

        async def client():
            async with contextlib.aclosing(ae.generate("gone", [5, 6, 7], PARAMS)) as g:
                async for _ in g:
                    pass
        task = asyncio.ensure_future(client())
        await asyncio.sleep(0.01)    # its add_request is queued, waiting for the step to end
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await first
        await long.aclose()
        await ae.call(lambda: None)   # every command queued before this one has run
        assert engine.seqs == {} and engine.block_manager.num_used == 0
        assert engine.stats.aborts.get("queued", 0) + engine.stats.aborts.get("running", 0) == 2
        engine.block_manager.check_invariant()
        ae.stop()
    asyncio.run(main())


def test_remote_handover_respects_max_num_seqs(tiny_llama):
    """With max_num_seqs 1, a remote prefill that completes while another request runs waits for a
    slot (blocks held, first token out) instead of overfilling the batch."""
    cfg = dict(model=str(tiny_llama), block_size=4, max_num_seqs=1)
    prefill, decode = LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))
    prompt = list(range(1, 20))
    decode.add_request("local", prompt_token_ids=prompt, params=PARAMS)
    decode.step()
    seq = decode.add_remote_request("remote", prompt, PARAMS)
    assert seq is not None
    kv = []
    prefill.add_request("p", prompt_token_ids=prompt, params={**PARAMS.model_dump(), "max_tokens": 1},
                        kv_sink=lambda s, first, data: kv.append((first, data)), stop_after_first_token=True)
    (done,) = [o for o in prefill.step() if o.finished]
    for first_block, data in kv:
        decode.write_kv("remote", first_block, data)
    out = decode.complete_remote("remote", done.new_token_ids[0])
    assert not out.finished and len(decode.scheduler.running) == 1
    finished = set()
    while decode.has_unfinished():
        for o in decode.step():
            assert len(decode.scheduler.running) <= 1
            if o.finished:
                finished.add(o.request_id)
    assert finished == {"local", "remote"}
    assert decode.block_manager.num_used == 0
