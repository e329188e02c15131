"""Freeing held KV: a release whose caller gives up while the sends reading the blocks stop
still frees them (the lease is out of the table by then: nothing else would)."""

from __future__ import annotations

import asyncio

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.prefill.config import PrefillConfig
from services.prefill.worker import PrefillWorker


def test_a_release_cancelled_while_sends_stop_still_frees_the_blocks(tiny_model):
    async def scenario() -> tuple[int, int]:
        config = PrefillConfig(
            model=tiny_model, etcd=None, ucx=False, engine=EngineConfig(num_blocks=32)
        )
        worker = PrefillWorker(config)
        await worker.start("127.0.0.1:0")
        try:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            result = await worker.prefill("r1", list(range(4, 60)), params, discard_kv=False)
            lease = worker.leases.pop(result.handle.handle_id, result.handle.access_token)

            async def send() -> None:  # a send that takes a moment to stop once cancelled
                try:
                    await asyncio.sleep(30)
                finally:
                    await asyncio.shield(asyncio.sleep(0.3))

            task = asyncio.create_task(send())
            lease.begin_send(task)
            task.add_done_callback(lease.end_send)
            await asyncio.sleep(0)
            release = asyncio.create_task(worker.free(lease))
            await asyncio.sleep(0.05)
            release.cancel()  # its caller gave up (a deadline, a dead client)
            await asyncio.sleep(0.6)
            pool = worker.engine.pool
            return pool.num_free, pool.num_blocks
        finally:
            await worker.stop()

    free, total = asyncio.run(scenario())
    assert free == total
