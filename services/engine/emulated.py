"""The emulated model runner: the forward pass replaced by its modelled time on another device.

An emulated engine is the real engine (the same `LLMEngine`: prefill batcher, continuous
batching, block pool, preemption, stop handling) with this runner in place of `ModelRunner`. It
loads no weights. Its model is an emulated folder (`presets.create_emulated`: a shape and a
tokenizer), and for that shape it models

* **time**: a prefill batch or a decode step lasts what the latency model says
  (`services.common.latency`, the very object the planner's simulator uses) on `tp` devices, on
  the mesh's clock (`services.common.clock`: run `--time-scale K` times slower than the wall).
  The engine thread sleeps for it: it burns no CPU. Steps that follow each other keep the
  profile's cadence: the engine's own work between them overlaps the modelled time;
* **memory**: the KV pool holds as many blocks as the device's memory leaves beside the
  weights (`model_spec.kv_capacity`, the planner's sizing), so admission, preemption and the
  gateway's watermarks feel the pressure a real device would;
* **KV**: every block holds a small real payload, `PAYLOAD` (2 layers, 1 head of 2 values per
  token: the token id and its position, as float32), written by prefill and decode as a real
  model writes its KV. The KV handoff moves it for real (handles, leases, chunked UCX pulls,
  checksums, retries); the time a transfer takes is modelled by the puller (`ModelledLink`);
* **tokens**: the next token is a hash of the seed and of the payload of the whole context, read
  from the KV cache, like a real model whose output is a function of its KV. So tokens are
  deterministic, equal on every mesh shape (1P1D, 2P1D, colocated, after migration or
  preemption), and KV that arrived wrong or incomplete gives other tokens, as it would with a
  real model. Sampled requests (temperature > 0) mix in their own random stream. Ids are drawn
  from the tokenizer's vocabulary, EOS included: `ignore_eos`, `max_tokens` and `min_tokens`
  (a stop id drawn too early is drawn again) behave as for a real model.
* **logits processors**: there are no logits, so presence, frequency and repetition penalties,
  min_p and logit_bias have nothing to act on: the engine validates them as the real one does
  (the same `SamplingParams` and vocabulary checks) and the tokens stay the hash's.
* **log-probabilities**: none to report either. Inventing them (a point mass on the hash's
  token) would pass for a model's distribution, so a request asking for `logprobs` or
  `prompt_logprobs` is refused (INVALID_ARGUMENT / HTTP 400 naming the field and this engine).
* **structured output** is honoured: a constrained sequence's token is drawn by the hash among
  the tokens its grammar allows next (the real grammar engine, the real per-step mask cost on
  the CPU), so its answers match their schema, regex or choice as a real model's do, and end
  when complete (or at max_tokens: a hash does not aim for the end as a trained model does).

What it proves, and what it does not: docs/engine.md ("The emulated engine").
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from services.common import clock
from services.common.errors import UnsupportedModel
from services.common.latency import LatencyModel, for_model
from services.common.model_config import ModelConfig
from services.common.model_spec import GIB, ModelSpec, kv_capacity, model_spec
from services.engine.config import EngineConfig
from services.engine.kv_cache import KvCache, KvGeometry
from services.engine.sequence import Sequence

# An emulated engine's KV payload per token: (token id, position) in one head of two float32
# values, in two layers (so that the layer-wise handoff publishes and pulls layer by layer).
PAYLOAD = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=2)
# A numpy array in host memory: an emulated engine's process never imports torch.
PAYLOAD_DTYPE = np.dtype(np.float32)
_MASK = 2**64 - 1


def spec_of(model_dir: Path, mc: ModelConfig) -> ModelSpec:
    """The modelled shape an emulated folder describes (its `distserve_model_spec`)."""
    raw = json.loads((model_dir / "config.json").read_text())
    fields = raw.get("distserve_model_spec")
    if fields:
        return ModelSpec(**fields)
    return model_spec(mc.emulated)


def fingerprint(model_dir: Path, mc: ModelConfig) -> str:
    """A name of what an emulated engine's KV depends on, for the prefix cache's salt: the
    modelled shape and the folder (its tokenizer)."""
    return f"emulated:{spec_of(model_dir, mc)}:{model_dir.resolve()}"


class StepTimes:
    """How long a prefill batch and a decode step of one instance take, in seconds, from the
    latency model (as the planner's simulator times them: a prefill batch pays the profile's
    per-stage overhead too)."""

    def __init__(self, latency: LatencyModel, tp: int) -> None:
        self.latency = latency
        self.tp = tp
        self._at = latency.at(tp)

    def prefill_s(self, sum_l: int, sum_l2: int) -> float:
        return self.latency.prefill_stage_ms(self.tp, 1, sum_l, sum_l2) / 1000

    def decode_s(self, batch: int, sum_ctx: int) -> float:
        return self._at.decode_ms(batch, sum_ctx) / 1000


def build(
    model_dir: Path, mc: ModelConfig, config: EngineConfig, vocab: int
) -> tuple[EmulatedRunner, int]:
    """The runner of an emulated engine for the emulated folder `model_dir`, and the number of
    blocks of its pool."""
    em = config.emulation
    spec = spec_of(model_dir, mc)
    latency = for_model(spec, em.profile, em.profile_fit)
    tokens = kv_capacity(spec, em.tp, 1, int(em.gpu_memory_gib * GIB), em.memory_utilization)
    num_blocks = tokens // config.block_size
    if num_blocks < 1:
        raise UnsupportedModel(
            f"{spec.name} on {em.tp} x {em.gpu_memory_gib:g} GiB leaves no room for KV "
            f"({spec.weight_bytes / GIB:.1f} GiB of weights): give more devices or memory"
        )
    cache = KvCache(
        num_layers=PAYLOAD.num_layers,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_kv_heads=PAYLOAD.num_kv_heads,
        head_dim=PAYLOAD.head_dim,
        dtype=PAYLOAD_DTYPE,
    )
    runner = EmulatedRunner(spec, StepTimes(latency, em.tp), cache, vocab, config.seed)
    return runner, num_blocks


class _Context:
    """A sequence's running hash of its KV payload: positions [0, hashed) are in it."""

    __slots__ = ("digest", "hashed")

    def __init__(self) -> None:
        self.digest = hashlib.blake2b(digest_size=8)
        self.hashed = 0


class EmulatedRunner:
    """`ModelRunner`'s interface (`prefill`, `decode`, `sample`, `cache`) with modelled time:
    see the module docstring. `prefill` and `decode` write the payload and wait out the step;
    `sample` reads the payload and picks each sequence's next token."""

    def __init__(
        self, spec: ModelSpec, times: StepTimes, cache: KvCache, vocab: int, seed: int
    ) -> None:
        self.spec = spec
        self.times = times
        self.cache = cache
        self.block_size = cache.block_size
        self.vocab = vocab
        self.seed = seed
        self.token_counts = None  # no logits, so no penalties to count tokens for
        self._contexts: weakref.WeakKeyDictionary[Sequence, _Context] = weakref.WeakKeyDictionary()
        # When the last step's modelled time ended (clock.monotonic()); inf once the engine
        # went idle. A step that follows another back to back starts where that one ended: the
        # engine's own work in between (scheduling, postprocessing, which a profile of the
        # forward pass leaves out) overlaps the modelled time instead of adding to it, so steps
        # keep the profile's cadence. After an idle wait the step starts when it is called.
        self._ended = math.inf

    def idle(self) -> None:
        """The engine waits for work: its next step starts when it is called."""
        self._ended = math.inf

    def _start(self) -> float:
        """When a step begins: the last one's end if it follows it back to back, else now."""
        return min(self._ended, clock.monotonic())

    def _run_until(self, end: float) -> None:
        self._ended = end
        clock.sleep_until(end)

    # -- the steps -------------------------------------------------------------------------------

    def prefill(self, seqs: list[Sequence], on_layer: Callable[[int], None] | None = None) -> None:
        """Write the prompts' payload, then wait out the batch's modelled time, publishing
        each payload layer (`on_layer`) at its share of it.

        A cached prefix (a sequence's first `num_cached_tokens`) is neither written nor timed:
        the batch costs its L computed tokens per prompt, and the attention term (sum of L^2
        for whole prompts) counts their pairs with the cached C tokens too: L^2 + 2 C L."""
        start = self._start()
        sum_l = sum_l2 = 0
        slots, ids, positions = [], [], []
        for seq in seqs:
            c, n = seq.num_cached_tokens, seq.num_tokens
            sum_l += n - c
            sum_l2 += (n - c) * (n + c)  # (n - c)^2 + 2 c (n - c)
            slots.extend(_slots(seq, c, n, self.block_size))
            ids.extend(seq.token_ids[c:])
            positions.extend(range(c, n))
            self._contexts.pop(seq, None)  # its KV is written anew (e.g. after preemption)
        seconds = self.times.prefill_s(sum_l, sum_l2)
        self._write(slots, ids, positions)
        layers = self.cache.num_layers
        for i in range(layers):
            self._run_until(start + seconds * (i + 1) / layers)
            if on_layer is not None:
                on_layer(i)

    def decode(self, seqs: list[Sequence]) -> None:
        """Write each sequence's last token's payload, then wait out the step's modelled time."""
        start = self._start()
        bs = self.block_size
        slots, ids, positions = [], [], []
        context = 0
        for seq in seqs:
            n = seq.num_tokens
            pos = n - 1
            slots.append(seq.block_table.blocks[pos // bs] * bs + pos % bs)
            ids.append(seq.token_ids[-1])
            positions.append(pos)
            context += n
        self._write(slots, ids, positions)
        self._run_until(start + self.times.decode_s(len(seqs), context))

    def score(self, _: None, seqs: list[Sequence]) -> None:
        """No logits, so no log-probabilities: the engine refuses requests that ask for them
        (logprobs, prompt_logprobs), naming this engine."""
        return None

    def sample(self, _: None, seqs: list[Sequence]) -> list[int]:
        """The next token of each sequence: a hash of the seed and its whole KV payload (and,
        when sampling, a draw of its own random stream). The payload is read from the cache:
        all of it the first time a sequence is seen here (a pulled one: what arrived), then
        the position each step wrote."""
        bs = self.block_size
        contexts, counts, slots = [], [], []
        for seq in seqs:
            ctx = self._contexts.get(seq)
            if ctx is None:
                ctx = self._contexts[seq] = _Context()
            n = seq.num_tokens
            slots += _slots(seq, ctx.hashed, n, bs)
            counts.append(n - ctx.hashed)
            ctx.hashed = n
            contexts.append(ctx)
        rows = self._read(slots)
        out = []
        at = 0
        for seq, ctx, count in zip(seqs, contexts, counts, strict=True):
            ctx.digest.update(rows[at : at + count].tobytes())
            at += count
            h = int.from_bytes(ctx.digest.digest(), "little") ^ self.seed
            if seq.params.temperature > 0:
                h ^= int(seq.draw() * 2**53)
            if seq.matcher is not None:
                out.append(_allowed_draw(seq, h))
                continue
            token = _mix(h) % self.vocab
            while token in seq.stop_token_ids and seq.num_output_tokens < seq.params.min_tokens:
                h += 1
                token = _mix(h) % self.vocab
            out.append(token)
        return out

    # -- the payload -----------------------------------------------------------------------------

    def _write(self, slots: list[int], ids: list[int], positions: list[int]) -> None:
        if not slots:
            return
        index = np.array(slots, dtype=np.int64)
        # (T, heads=1, 2): K holds (id, position), V (position, id)
        k = np.array([ids, positions], dtype=PAYLOAD_DTYPE).T.reshape(-1, 1, 2)
        v = k[..., ::-1]
        for layer in range(self.cache.num_layers):
            keys, values = self.cache.layer(layer)
            keys[index] = k
            values[index] = v

    def _read(self, slots: list[int]) -> np.ndarray:
        """The payload of cache slots, every layer, K and V: (T, layers * 2, heads, head_dim)."""
        index = np.array(slots, dtype=np.int64)
        parts = []
        for layer in range(self.cache.num_layers):
            keys, values = self.cache.layer(layer)
            parts += [keys[index], values[index]]
        return np.stack(parts, axis=1)


def _slots(seq: Sequence, first: int, end: int, bs: int) -> list[int]:
    """Cache slots of positions [first, end) of a sequence."""
    blocks = seq.block_table.blocks
    return [blocks[p // bs] * bs + p % bs for p in range(first, end)]


def _allowed_draw(seq: Sequence, h: int) -> int:
    """A structured-output sequence's next token: drawn by the hash among those its grammar
    allows next (stop ids left out while min_tokens is unmet, unless nothing else is allowed)."""
    allowed = seq.matcher.allowed()
    if seq.num_output_tokens < seq.params.min_tokens:
        free = allowed[~np.isin(allowed, list(seq.stop_token_ids))]
        allowed = free if len(free) else allowed
    return int(allowed[_mix(h) % len(allowed)])


def _mix(h: int) -> int:
    """splitmix64's finaliser: spreads a hash's bits over all 64."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)
