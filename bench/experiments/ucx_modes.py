"""What UCX progress modes cost a message: round trips and idle CPU, two processes.

ucxx's async layer has a `thread` mode (with Python futures: a UCX progress thread, a notifier
thread that hands completions to the event loop, and the loop; a message's arrival crosses three
threads) and a `blocking` mode (the event loop progresses UCX itself when the worker's file
descriptor is readable; ucxx then waits for each request by yielding to the loop in a loop).
This bench measures both against `evloop`, the mesh's own
(services/kvtransfer/ucx_loop.py: the loop progresses UCX when the descriptor is readable and
completes each request's future itself; no extra thread, nothing spinning), in one run, between
two processes on one host (shared memory):
  * round trips of 1 KiB (a request or status frame) and 1 MiB (a small chunk), each an 8-byte
    header and the payload one way and the payload back: p10, p50, p90 and p99 over
    `--round-trips` after a warm-up;
  * the CPU each process spends idle for `--idle-s` seconds with one receive posted (a chunk
    server always has one), and its progress thread's wake-ups per second.
Prints a table and one JSON line. Run: `python bench/experiments/ucx_modes.py` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.report import cpu_model
from services.common.stats import percentile

MODES = {
    "thread": {"UCXPY_PROGRESS_MODE": "thread", "UCXPY_ENABLE_PYTHON_FUTURE": "1"},
    "blocking": {"UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "evloop": {},  # the mesh's: services/kvtransfer/ucx_loop.py, on ucxx's low-level API
}
SIZES = {"1KiB": 1024, "1MiB": 2**20}
TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TCK


def wakeups(pid: int) -> int:
    """Voluntary context switches of all the process's threads (each a wait that ended)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        total += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


def listen(mode: str, handle) -> int:
    global _listener  # kept alive while the server runs
    if mode == "evloop":
        from services.kvtransfer import ucx_loop

        _listener = ucx_loop.worker().listen(handle)
    else:
        import ucxx

        _listener = ucxx.create_listener(handle, 0)
    return _listener.port


async def connect(mode: str, port: int):
    if mode == "evloop":
        from services.kvtransfer import ucx_loop

        return await ucx_loop.worker().connect("127.0.0.1", port)
    import ucxx

    return await ucxx.create_endpoint("127.0.0.1", port)


async def echo_server(mode: str) -> None:
    """Echoes every message back; prints its port."""
    import numpy as np

    async def handle(ep) -> None:
        buf = np.empty(max(SIZES.values()), dtype=np.uint8)
        try:
            while True:
                n = int(np.frombuffer(await _recv_header(ep), dtype=np.int64)[0])
                if n == 0:  # idle: a receive stays posted until the client closes
                    continue
                await ep.recv(buf[:n])
                await ep.send(buf[:n])
        except Exception:
            pass  # the client closed its endpoint

    print(listen(mode, handle), flush=True)
    await asyncio.Event().wait()


async def _recv_header(ep):
    import numpy as np

    header = np.empty(8, dtype=np.uint8)
    await ep.recv(header)
    return header


async def client(mode: str, port: int, server_pid: int, round_trips: int, idle_s: float) -> dict:
    import numpy as np

    ep = await connect(mode, port)
    out: dict = {"rtt_us": {}}
    for name, size in SIZES.items():
        data = np.zeros(size, dtype=np.uint8)
        back = np.empty(size, dtype=np.uint8)
        header = np.array([size], dtype=np.int64)
        times = []
        for i in range(round_trips + 100):
            t = time.perf_counter()
            await ep.send(header)
            await ep.send(data)
            await ep.recv(back)
            if i >= 100:  # warm-up
                times.append(time.perf_counter() - t)
        out["rtt_us"][name] = {f"p{p}": round(percentile(times, p) * 1e6) for p in (10, 50, 90, 99)}
    await ep.send(np.array([0], dtype=np.int64))  # the server posts its next receive and waits
    await asyncio.sleep(0.5)
    pids = {"server": server_pid, "client": os.getpid()}
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    wake0 = {k: wakeups(p) for k, p in pids.items()}
    await asyncio.sleep(idle_s)
    out["idle_cpu_ms_per_s"] = {
        k: round((cpu_s(p) - cpu0[k]) / idle_s * 1e3, 1) for k, p in pids.items()
    }
    out["idle_wakeups_per_s"] = {
        k: round((wakeups(p) - wake0[k]) / idle_s) for k, p in pids.items()
    }
    await ep.close()
    return out


def run_mode(mode: str, round_trips: int, idle_s: float) -> dict:
    from services.kvtransfer.ucx_setup import UCX_DEFAULTS

    env = {**os.environ, **UCX_DEFAULTS, **MODES[mode], "UCX_TLS": "tcp,sm,cma,self"}
    me = [sys.executable, os.path.abspath(__file__)]
    server = subprocess.Popen([*me, "--serve", mode], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = server.stdout.readline().strip()
        limits = ("--round-trips", str(round_trips), "--idle-s", str(idle_s))
        result = subprocess.run(
            [*me, "--client", port, "--mode", mode, "--server-pid", str(server.pid), *limits],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if result.returncode:
            sys.stderr.write(result.stderr[-3000:])
            raise SystemExit(f"the {mode} client failed")
        return json.loads(result.stdout.splitlines()[-1])
    finally:
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--client", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--round-trips", type=int, default=1000)
    ap.add_argument("--idle-s", type=float, default=5.0)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(echo_server(args.serve))
        return
    if args.client:
        result = asyncio.run(
            client(args.mode, args.client, args.server_pid, args.round_trips, args.idle_s)
        )
        print(json.dumps(result))
        if args.mode != "evloop":
            import ucxx

            ucxx.stop_notifier_thread()
        return

    results = {mode: run_mode(mode, args.round_trips, args.idle_s) for mode in MODES}
    print(
        f"\nucxx progress modes: {cpu_model()}, {os.cpu_count()} cpus, two processes, shared memory"
    )
    print(f"{'mode':10} {'size':5} {'p10':>7} {'p50':>7} {'p90':>7} {'p99':>7}  (round trip, us)")
    for mode, r in results.items():
        for size, q in r["rtt_us"].items():
            print(f"{mode:10} {size:5} {q['p10']:7} {q['p50']:7} {q['p90']:7} {q['p99']:7}")
    for mode, r in results.items():
        cpu, wake = r["idle_cpu_ms_per_s"], r["idle_wakeups_per_s"]
        print(
            f"{mode:10} idle, one receive posted: CPU {cpu['server']} / {cpu['client']} ms a "
            f"second (server / client), {wake['server']} / {wake['client']} wake-ups a second"
        )
    p50 = {mode: r["rtt_us"]["1KiB"]["p50"] for mode, r in results.items()}
    print(
        json.dumps(
            {
                "bench": "ucx_modes",
                "cpu_count": os.cpu_count(),
                "round_trips": args.round_trips,
                **{f"{mode}_{k}": v for mode, r in results.items() for k, v in r.items()},
                "rtt_p50_thread_over_blocking_1KiB": round(p50["thread"] / p50["blocking"], 1),
                "rtt_p50_thread_over_evloop_1KiB": round(p50["thread"] / p50["evloop"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
