"""Resident memory of a mesh's processes, sampled, and the bound each may not exceed (the
overload bench's, `bench/overload/overload.py`).

The bound: idle + `allowance()`, term by term from what bounds memory in the code; the
constants are stated, not fitted:

* Every request the mesh holds state for was admitted by the gateway, which holds at most
  `--max-inflight` (M = 1024) at once; each is at most the model's context C (4096 tokens,
  prompt + output) long. With admission off there is no M: no bound exists, and the baseline
  shows what that costs.
* A worker's KV pool (`--kv-cache-gib`) is zero-filled, its pages faulted in, when the engine
  starts (`services.engine.kv_cache.host_zeros`), so it is resident at idle already, as are the
  weights: no KV term. On top of idle a worker may hold: the activations of its largest step
  (prefill: one batch of `--max-batch-tokens` T tokens, T x (4 hidden + 3 intermediate + vocab)
  x 4 B, plus attention scores heads x T^2 x 4 B as if materialised for one prompt of T tokens;
  decode: `--max-num-seqs` S sequences, S x (4 hidden + 3 intermediate + vocab) x 4 B plus S x
  heads x C x 4 B of scores); KV chunks in flight: S pulls (a decode instance pulls for at most
  its free seats), each with at most the puller's window of chunks posted
  (`services.kvtransfer.puller.PullPolicy`: `window` x `chunk_bytes`, read from the code, not
  restated here) and never more than a request's whole KV (C tokens x
  `ModelConfig.kv_bytes_per_token`), whichever is less; zero when the transport writes in place,
  as UCX does for a pull of every head, but a buffer per chunk over the gRPC fallback or a head
  split; the state of M queued requests, M x (C x 36 B (a token id in a Python list: an 8-byte
  slot and a 28-byte int) + 64 KiB (a gRPC stream's receive window and call objects)); and
  64 MiB for allocator slack, thread stacks and metrics.
* The gateway: M x (C x 80 B (the ids in two Python lists and protobuf copies) + 3 x 64 KiB (the
  client's stream and the calls to prefill and decode)) + 64 MiB.
"""

from __future__ import annotations

import statistics
import threading
import time

from distserve.loadgen.procfs import command_name, descendants, rss_bytes
from distserve.local_mesh import Mesh
from services.common.model_config import ModelConfig
from services.kvtransfer.puller import PullPolicy

MiB = 2**20
# The bound's stated constants (see the module docstring).
PY_TOKEN_BYTES = 36  # a token id in a Python list: 8 B slot + 28 B int object
GATEWAY_TOKEN_BYTES = 80  # two Python lists and protobuf copies of each id
CALL_BYTES = 64 * 2**10  # one gRPC stream: its receive window and call objects
FIXED_BYTES = 64 * MiB  # allocator slack, thread stacks, metrics
FLOAT_BYTES = 4  # fp32 activations


class RssSampler:
    """VmRSS of every process of a mesh (and their descendants), sampled on a thread."""

    def __init__(self, mesh: Mesh, interval_s: float) -> None:
        self.roots = {p.name: p.popen.pid for p in mesh.processes}
        self.interval_s = interval_s
        self.role = {}  # process name -> the role whose bound applies
        self.samples: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict[str, int]:
        """One reading: name -> bytes. A descendant is named ROOT/COMM-PID."""
        out = {}
        for name, pid in self.roots.items():
            rss = rss_bytes(pid)
            if rss is not None:
                out[name] = rss
                self.role.setdefault(name, role_of(name))
            for child in descendants(pid):
                rss = rss_bytes(child)
                if rss is not None:
                    key = f"{name}/{command_name(child)}-{child}"
                    out[key] = rss
                    self.role.setdefault(key, role_of(name))
        return out

    def idle(self, n: int = 4) -> dict[str, int]:
        """The median of `n` readings one interval apart."""
        readings = []
        for i in range(n):
            if i:
                time.sleep(self.interval_s)
            readings.append(self.read())
        names = set().union(*readings)
        return {k: int(statistics.median(r[k] for r in readings if k in r)) for k in names}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for k, v in self.read().items():
                self.samples.setdefault(k, []).append(v)


def role_of(name: str) -> str:
    return "gateway" if name == "gateway" else name.split("-")[0]


def engine_options(args: tuple[str, ...]) -> dict[str, float]:
    """`--kv-cache-gib 0.375 --max-num-seqs 16 ...` as {"kv_cache_gib": 0.375, ...}."""
    pairs = zip(args[::2], args[1::2], strict=True)
    return {
        k.removeprefix("--").replace("-", "_"): float(v) if "." in v else int(v) for k, v in pairs
    }


def allowance(role: str, model: ModelConfig, engine: dict[str, int], max_inflight: int) -> dict:
    """What a process of `role` may hold on top of its idle RSS, term by term (bytes), from the
    mechanisms that bound it; see the module docstring."""
    ctx = model.max_position_embeddings
    if role == "gateway":
        terms = {
            "requests": max_inflight * (ctx * GATEWAY_TOKEN_BYTES + 3 * CALL_BYTES),
            "fixed": FIXED_BYTES,
        }
        formula = (
            f"M x (C x {GATEWAY_TOKEN_BYTES} B + 3 x 64 KiB) + 64 MiB, M={max_inflight}, C={ctx}"
        )
        return {"terms": terms, "total": sum(terms.values()), "formula": formula}
    per_token = (
        4 * model.hidden_size + 3 * model.intermediate_size + model.vocab_size
    ) * FLOAT_BYTES
    seqs, batch = engine["max_num_seqs"], engine["max_batch_tokens"]
    policy = PullPolicy()
    if role == "decode":
        act = seqs * per_token + seqs * model.num_heads * ctx * FLOAT_BYTES
        act_text = "S x (4h + 3i + V) x 4 B + S x heads x C x 4 B"
    else:  # prefill (colocated would need both; this bench runs none)
        act = batch * per_token + model.num_heads * batch * batch * FLOAT_BYTES
        act_text = "T x (4h + 3i + V) x 4 B + heads x T^2 x 4 B"
    # A pull posts at most its window of chunks, and never more than the request's whole KV.
    kv_token = model.kv_bytes_per_token(FLOAT_BYTES)
    per_pull = min(policy.window * policy.chunk_bytes, ctx * kv_token)
    terms = {
        "activations": act,
        "kv_in_flight": seqs * per_pull,
        "requests": max_inflight * (ctx * PY_TOKEN_BYTES + CALL_BYTES),
        "fixed": FIXED_BYTES,
    }
    formula = (
        f"{act_text} + S x min({policy.window} x {policy.chunk_bytes // MiB} MiB, C x "
        f"{kv_token} B) + M x (C x {PY_TOKEN_BYTES} B + 64 KiB) + 64 MiB, T={batch}, S={seqs}, "
        f"M={max_inflight}, C={ctx}"
    )
    return {"terms": terms, "total": sum(terms.values()), "formula": formula}


def process_order(name: str) -> tuple:
    base = name.split("/")[0]
    return ({"gateway": 0, "prefill": 1, "decode": 2}.get(role_of(base), 3), name)


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:,.0f}"


def memory_table(on: dict, off: dict, bounds: dict) -> tuple[str, dict, bool]:
    """The per-process memory table and its JSON, and whether every process of the admission-on
    run stayed within its bound."""
    lines = [
        f"{'process (VmRSS MiB)':<28} {'start':>6} {'idle':>6} {'peak':>6} {'+':>5} "
        f"{'bound':>6} {'within':>6} | {'baseline idle':>13} {'peak':>6} {'+':>6}"
    ]
    out, within_all = {}, True
    names = sorted(set(on["rss"]) | set(off["rss"]), key=process_order)
    for name in names:
        a, b = on["rss"].get(name), off["rss"].get(name)
        row = {}
        if a is not None:
            bound = a["idle"] + bounds[a["role"]]["total"]
            within = a["peak"] <= bound
            within_all &= within
            row.update(idle=a["idle"], peak=a["peak"], start=a["start"], bound=bound, within=within)
        if b is not None:
            row["baseline"] = {"idle": b["idle"], "peak": b["peak"], "start": b["start"]}
        out[name] = row
        lines.append(
            f"{name:<28} {mib(a and a['start']):>6} {mib(a and a['idle']):>6} "
            f"{mib(a and a['peak']):>6} {mib(a and a['peak'] - a['idle']):>5} "
            f"{mib(row.get('bound')):>6} {('yes' if row['within'] else 'NO') if a else '-':>6} | "
            f"{mib(b and b['idle']):>13} {mib(b and b['peak']):>6} "
            f"{mib(b and b['peak'] - b['idle']):>6}"
        )
    return "\n".join(lines), out, within_all
