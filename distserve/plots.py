"""matplotlib is an extra (`pip install 'distserve-mesh[plots]'`): only the PNGs of
`distserve bench` and `distserve trace-report --png` draw with it, and the serving image leaves
it out (about 100 MB with its fonts and imaging libraries). A command that would draw checks
first, before any work, and names the extra."""

from __future__ import annotations

import importlib.util

from services.common.errors import InvalidRequest


def require_matplotlib(what: str) -> None:
    """Refuse `what` up front when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidRequest(
            f"{what} draws with matplotlib, which this install lacks: "
            "pip install 'distserve-mesh[plots]'"
        )
