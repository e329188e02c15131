"""The engine thread of a prefill instance: layer-wise requests are reported as scheduled and
layer by layer; a batch without one runs without waking the event loop for it."""

from __future__ import annotations

import asyncio

from services.common.sampling import SamplingParams
from services.engine.commands import AddRequest
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.engine_loop import EngineLoop


async def prefill(loop: EngineLoop, request_id: str, layerwise: bool) -> None:
    if layerwise:
        loop.layerwise.add(request_id)
    queue = loop.subscribe(request_id)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    loop.submit(request_id, AddRequest([5, 6, 7, 8, 9], params, request_id))
    out, _ = await asyncio.wait_for(queue.get(), 30)
    assert out.new_token_ids and not out.finished
    loop.unsubscribe(request_id)
    loop.layerwise.discard(request_id)


def test_only_layerwise_requests_are_reported_per_layer(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64), detokenize=False)
    scheduled: list[list[str]] = []
    layers: list[tuple[list[str], int]] = []

    async def main() -> None:
        loop = EngineLoop(
            engine,
            hold=True,
            on_scheduled=lambda batch: scheduled.append([rid for rid, _ in batch]),
            on_layer=lambda ids, i: layers.append((list(ids), i)),
        )
        loop.start()
        try:
            await prefill(loop, "plain", layerwise=False)
            await asyncio.sleep(0.05)  # anything the step sent has arrived
            assert scheduled == [] and layers == []
            await prefill(loop, "streamed", layerwise=True)
            await asyncio.sleep(0.05)
        finally:
            loop.stop()

    asyncio.run(main())
    assert scheduled == [["streamed"]]
    n = engine.model_config.num_layers
    assert layers == [(["streamed"], i) for i in range(n)]
