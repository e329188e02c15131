"""Where a request goes: its serving path and the instances that serve it.

Every choice of an instance is made here, from the registry's membership and load
(gateway/registry.py) and, for a worker with a prefix cache, the part of the prompt it holds
(gateway/prefix_index.py):
- a prefill instance by the prompt tokens it would compute before this prompt's first token
  (its queue plus the prompt's part not in its cache);
- a decode or colocated instance by load (open requests, then KV headroom) and, among those
  within `DECODE_AFFINITY_SLACK` requests of the least loaded, by the prefix it holds;
- the serving path: one colocated instance, a decode instance that prefills a short prompt
  itself (conditional disaggregation: gateway/conditional.py), or disaggregated (the handoff
  then asks here for its prefill and decode instances, and again on a retry).
"""

from __future__ import annotations

from services.common import telemetry
from services.common.errors import Unavailable
from services.gateway.conditional import LocalPrefill
from services.gateway.prefix_index import PromptBlocks
from services.gateway.registry import Registry, Worker
from services.gateway.request import Request

# A decode or colocated instance holding more of a prompt is preferred over the least loaded
# one if it has at most this many more requests open: one request more in a decode batch costs
# its others little, and a cached prefix saves pulling (or computing) that part of the prompt.
DECODE_AFFINITY_SLACK = 2

POLICIES = ("prefix", "load", "round-robin")  # see Routing


class Routing:
    """Chooses instances for requests.

    `policy`: "prefix" weighs each worker's cached prefix of the prompt and its load (the
    default); "load" the load alone; "round-robin" takes the workers of a role in turn (both
    for comparison). `local_prefill`: which short prompts a decode instance may prefill itself
    (None: none)."""

    def __init__(
        self,
        registry: Registry,
        policy: str = "prefix",
        local_prefill: LocalPrefill | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {POLICIES}, not {policy!r}")
        self.registry = registry
        self.policy = policy
        self.local_prefill = local_prefill
        self._turns: dict[str, int] = {}  # round-robin: picks so far, by role
        # Prompt tokens routed, by (role, kind): "prompt" all of them, "cached" those the chosen
        # worker holds, "best" those the worker holding the most of each prompt holds.
        self.prefix_tokens: dict[tuple[str, str], int] = {}

    def mode(self) -> str:
        """How requests are served now: disaggregated when both pools exist, else colocated."""
        if self.registry.live("prefill") and self.registry.live("decode"):
            return "disaggregated"
        if self.registry.live("colocated"):
            return "colocated"
        raise Unavailable(
            "no complete serving path: register a prefill and a decode instance, or a colocated one"
        )

    def one_instance(self, req: Request, prompt: PromptBlocks) -> Worker | None:
        """The instance that serves the whole request (both phases), or None: disaggregate it.
        A colocated instance when that is the mesh; otherwise, conditional disaggregation, the
        decode instance this prompt would go to, if the prompt's part not cached there is short
        and it has headroom (nothing queued to prefill there yet, free KV for the prompt)."""
        if self.mode() == "colocated":
            return self.pick_decode(prompt, role="colocated")
        rule = self.local_prefill
        if rule is None:
            return None
        worker = self.pick_decode(prompt)
        uncached = len(req.prompt_ids) - prompt.cached_tokens(worker.cache)
        load = worker.load
        if (
            rule.allows(uncached)
            and worker.queued_tokens == 0
            and load.waiting_seqs == 0
            and load.free_kv_tokens > uncached + req.params.max_tokens
        ):
            return worker
        return None

    def pick_prefill(
        self, prompt: PromptBlocks | None = None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> Worker:
        """The prefill instance that would reach `prompt`'s first token soonest: the fewest
        prompt tokens to compute there first (queued ones, then the prompt's part not in its
        prefix cache); without a prompt, the fewest queued. Instances not in `exclude` (those a
        request already tried) are preferred."""
        workers = self._candidates("prefill", exclude)
        if self.policy == "round-robin":
            return self._turn("prefill", workers)
        if prompt is None or self.policy == "load":
            return min(workers, key=lambda w: (w.queued_tokens, w.worker_id))
        n = len(prompt.token_ids)

        def first_token_after(w: Worker) -> int:  # prompt tokens computed there first
            return w.queued_tokens + n - prompt.cached_tokens(w.cache)

        return min(workers, key=lambda w: (first_token_after(w), w.worker_id))

    def pick_decode(
        self,
        prompt: PromptBlocks | None = None,
        exclude: set[str] | frozenset[str] = frozenset(),
        role: str = "decode",
    ) -> Worker:
        """The least-loaded decode (or colocated) instance: fewest sequences running, waiting
        or being pulled; then the most KV headroom (`Worker.kv_headroom_tokens`). With a
        `prompt`, of the instances within `DECODE_AFFINITY_SLACK` requests of the least
        loaded, the one holding the longest prefix of it. Instances in `exclude` (those a
        request already failed on) only when there is no other."""
        workers = self._candidates(role, exclude)
        if self.policy == "round-robin":
            return self._turn(role, workers)

        def load(w: Worker) -> tuple:
            return (w.open_requests, -w.kv_headroom_tokens, w.worker_id)

        if prompt is None or self.policy == "load":
            return min(workers, key=load)
        least = min(w.open_requests for w in workers)
        near = [w for w in workers if w.open_requests <= least + DECODE_AFFINITY_SLACK]
        return min(near, key=lambda w: (-prompt.cached_tokens(w.cache), *load(w)))

    def _candidates(self, role: str, exclude: set[str] | frozenset[str]) -> list[Worker]:
        workers = self.registry.live(role)
        if not workers:
            raise Unavailable(f"no {role} instance is registered with the gateway")
        return [w for w in workers if w.worker_id not in exclude] or workers

    def _turn(self, role: str, workers: list[Worker]) -> Worker:
        n = self._turns[role] = self._turns.get(role, -1) + 1
        return sorted(workers, key=lambda w: w.worker_id)[n % len(workers)]

    def routed(self, trace, worker: Worker, prompt: PromptBlocks) -> int:
        """`prompt` goes to `worker`: its blocks count as held there from now on, and the
        prompt tokens cached there (and the most any worker of its role holds) go on the
        request's span (`distserve.<role>.cached_tokens`, `...best_cached_tokens`) and into
        `prefix_tokens`. Returns the tokens cached there."""
        role = worker.role
        cached = prompt.cached_tokens(worker.cache)
        best = max((prompt.cached_tokens(w.cache) for w in self.registry.live(role)), default=0)
        best = max(best, cached)
        for kind, n in (("prompt", len(prompt.token_ids)), ("cached", cached), ("best", best)):
            self.prefix_tokens[role, kind] = self.prefix_tokens.get((role, kind), 0) + n
        if worker.cache.enabled:
            telemetry.annotate(
                trace,
                {
                    f"distserve.{role}.cached_tokens": cached,
                    f"distserve.{role}.best_cached_tokens": best,
                },
            )
            worker.cache.predict(prompt.hashes(worker.cache))
        return cached
