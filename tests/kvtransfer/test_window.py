"""The pull's window: how many chunks may be in flight at once, granted in the order asked."""

import asyncio

from services.kvtransfer.transports import Window


def test_chunks_are_granted_in_the_order_asked_as_the_window_has_room():
    window = Window(chunks=2)
    granted = []
    for i in range(5):
        window.ask(lambda i=i: granted.append(i))
    assert granted == [0, 1]
    window.release()
    assert granted == [0, 1, 2]
    window.release()
    window.release()
    assert granted == [0, 1, 2, 3, 4]
    window.release()
    window.release()
    assert window.in_flight == 0


def test_a_withdrawn_ask_is_never_granted_and_holds_nobody_up():
    window = Window(chunks=1)
    granted = []
    window.ask(lambda: granted.append(0))
    withdraw = window.ask(lambda: granted.append(1))
    window.ask(lambda: granted.append(2))
    withdraw()
    window.release()
    assert granted == [0, 2]
    window.release()
    assert window.in_flight == 0


def test_a_slot_is_given_back_whether_its_holder_finishes_fails_or_is_cancelled():
    async def main() -> None:
        window = Window(chunks=1)
        async with window.slot():
            assert window.in_flight == 1
        assert window.in_flight == 0
        try:
            async with window.slot():
                raise RuntimeError("the chunk failed")
        except RuntimeError:
            pass
        assert window.in_flight == 0

        async def hold(entered: asyncio.Event, leave: asyncio.Event) -> None:
            async with window.slot():
                entered.set()
                await leave.wait()

        entered, leave, never = asyncio.Event(), asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(hold(entered, leave))
        await entered.wait()
        waiter = asyncio.create_task(hold(asyncio.Event(), never))  # queued behind the holder
        await asyncio.sleep(0)
        assert window.in_flight == 1
        leave.set()
        await asyncio.sleep(0)  # the holder leaves: the slot is granted to the waiter ...
        waiter.cancel()  # ... which is cancelled before it could enter
        await asyncio.gather(holder, waiter, return_exceptions=True)
        assert waiter.cancelled()
        assert window.in_flight == 0
        async with window.slot():  # the window still works
            assert window.in_flight == 1

    asyncio.run(main())
