"""The open loop: every request leaves at its arrival time, whatever earlier ones are doing."""

from __future__ import annotations

import asyncio
import time

from distserve.loadgen.requests import LoadRequest
from distserve.loadgen.results import LoadResult, RequestRecord
from distserve.loadgen.targets import LoadError, Target


async def run_load(
    target: Target,
    requests: list[LoadRequest],
    timeout_s: float | None = 120.0,
    until: int | None = None,
) -> LoadResult:
    """Send `requests` to `target` open loop (each at its `arrival_s` after the start, streamed,
    never waiting for earlier ones) and return what every one of them measured.

    One task schedules: it sleeps until the next arrival and starts that request's task, so the
    schedule does not drift with the number of requests. `timeout_s` bounds each request
    (DEADLINE_EXCEEDED or an HTTP timeout then counts as its error).

    Against an emulated mesh (`target.time_scale` > 1, services/common/clock.py) arrivals,
    timeouts and every time measured are in its time, which runs that many times slower than
    the wall.

    `until`: the run ends once the first `until` requests (in arrival order) have ended: those
    still to be sent are not, those in flight are cancelled (error `CANCELLED`), as the
    planner's simulator stops once the requests it judges have finished (the later ones only
    keep the mesh loaded meanwhile).
    """
    time_scale = target.time_scale
    if timeout_s is not None:
        timeout_s *= time_scale
    records = [RequestRecord(r.arrival_s, len(r.prompt_ids), r.max_tokens) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    await target.open()
    try:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []
        judged = asyncio.Event()  # the first `until` requests are sent

        async def send_all() -> None:
            for i in order:
                delay = t0 + requests[i].arrival_s * time_scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = records[i]
                tasks.append(
                    asyncio.create_task(
                        _one(target, requests[i], record, t0, time_scale, timeout_s)
                    )
                )
                if len(tasks) == until:
                    judged.set()

        sender = asyncio.create_task(send_all())
        if until is None or until >= len(requests):
            await sender
            await asyncio.gather(*tasks)
        else:
            await judged.wait()
            await asyncio.gather(*tasks[:until])
            sender.cancel()
            for task in tasks[until:]:
                task.cancel()
            await asyncio.gather(sender, *tasks, return_exceptions=True)
            for r in records:
                if r.sent_s != r.sent_s:  # NaN: never sent
                    r.error, r.error_message = "NOT_SENT", "the run ended before it was due"
        ends = [r.message_s[-1] for r in records if r.message_s]
        first = min((r.sent_s for r in records if r.sent_s == r.sent_s), default=0.0)
        duration = (max(ends) - first) if ends else 0.0
    finally:
        await target.close()
    return LoadResult.from_records(target.name, records, duration)


async def _one(
    target: Target,
    req: LoadRequest,
    rec: RequestRecord,
    t0: float,
    scale: float,
    timeout_s: float | None,
) -> None:
    rec.sent_s = (time.perf_counter() - t0) / scale
    try:
        async for chunk in target.stream(req, timeout_s):
            now = (time.perf_counter() - t0) / scale
            if chunk.tokens != 0:
                rec.message_s.append(now)
                rec.message_tokens.append(chunk.tokens)
            if chunk.total is not None:
                rec.server_tokens = chunk.total
    except asyncio.CancelledError:
        rec.error, rec.error_message = "CANCELLED", "the run ended before this request did"
    except LoadError as e:
        rec.error, rec.error_message = e.status, e.message
    except Exception as e:  # a bug in a target must not take the run down with it
        rec.error, rec.error_message = type(e).__name__, str(e)
