"""The decode side of a KV handle: its release at the source is sent exactly once, as soon as
its KV is here or when the request ends before that; a source that cannot be reached does
not hold up the request."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.decode.pull import SourceReleases


class Puller:
    def __init__(self, fail: bool = False) -> None:
        self.released: list[tuple[object, object]] = []
        self.fail = fail

    async def release(self, handle, trace=None) -> None:
        self.released.append((handle, trace))
        if self.fail:
            raise ConnectionError("source unreachable")


HANDLE = SimpleNamespace(handle_id="h1", source_instance="prefill-1")


def run(scenario, puller: Puller) -> list[tuple[object, object]]:
    async def main() -> None:
        releases = SourceReleases(puller)
        await scenario(releases)
        await asyncio.gather(*releases.pending)
        assert not releases.pending

    asyncio.run(main())
    return puller.released


def test_a_pulled_handle_is_released_once_with_the_handoff_context():
    async def scenario(releases: SourceReleases) -> None:
        with releases.hold(HANDLE) as release:
            release.pulled("handoff")

    assert run(scenario, Puller()) == [(HANDLE, "handoff")]


@pytest.mark.parametrize("error", [ValueError("pull failed"), asyncio.CancelledError()])
def test_a_handle_is_released_once_when_its_request_ends_before_the_pull(error):
    async def scenario(releases: SourceReleases) -> None:
        with pytest.raises(type(error)), releases.hold(HANDLE):
            raise error

    assert run(scenario, Puller()) == [(HANDLE, None)]


def test_a_request_without_a_handle_releases_nothing():
    async def scenario(releases: SourceReleases) -> None:
        with releases.hold(None):
            pass

    assert run(scenario, Puller()) == []


def test_a_failed_release_is_logged_not_raised(caplog):
    async def scenario(releases: SourceReleases) -> None:
        with releases.hold(HANDLE) as release:
            release.pulled(None)

    assert run(scenario, Puller(fail=True)) == [(HANDLE, None)]
    assert "release of h1 at prefill-1 failed: source unreachable" in caplog.text
