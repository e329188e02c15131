"""The sparse mixture-of-experts block that Mixtral, Qwen3-MoE and DeepSeek-V2 share.

A router (`gate`, replicated on every rank) scores each token against every expert; the token
goes to its top-k experts, weighted by the softmax of the scores (in float32, as transformers
computes them), renormalised over the k when the family says so, times a routed scaling factor
(DeepSeek's `routed_scaling_factor`). DeepSeek-V2's group-limited router first keeps, per token,
the `top_groups` groups of experts whose best expert scores highest, and picks the top k among
those. Each expert is a gated MLP; DeepSeek adds shared experts, one dense gated MLP every
token runs through, its output added to the routed experts' sum.

The experts are two stacked parameters, `gate_up_proj` (E, 2 * I_r, H) and `down_proj`
(E, H, I_r), filled expert by expert from the Hub checkpoint's per-expert tensors
(`Target(param, part, index=e)`). Under tensor parallelism every rank holds every expert's
slice of the intermediate dimension (column-parallel gate/up, row-parallel down, as Megatron and
vLLM do by default): a rank computes each routed token's partial output for its slice, weights
it, sums it per token, and one all-reduce per layer adds the ranks' sums. The shared experts
are split the same way (column-parallel gate/up, row-parallel down): their partial output joins
the routed sum before that one all-reduce.

The forward groups the routed (token, expert) pairs by expert: one matmul per expert over all
its rows, then a weighted scatter-add back to the tokens. Its Python loop is over experts, never
over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.models.base import CausalLM, Target
from services.engine.models.layers import ACTIVATIONS, GatedMLP, Split
from services.engine.parallel import TensorParallel


class Experts(nn.Module):
    """E gated MLPs stacked: gate_up_proj (E, 2 * I_r, H), down_proj (E, H, I_r), I_r this
    rank's share of the intermediate width. `names`: the checkpoint's names of each expert's
    gate, up and down projections (Mixtral: w1, w3, w2)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: str,
        tp: TensorParallel,
        names: tuple[str, str, str],
    ) -> None:
        super().__init__()
        gate_up = Split(0, (intermediate, intermediate), tp.rank, tp.world_size)
        self.intermediate = per = gate_up.per(0)
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * per, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, per))
        # Splits of one expert's matrix (the loader fills gate_up_proj[e], down_proj[e]).
        self.splits = {
            "gate_up_proj": gate_up,
            "down_proj": Split(1, (intermediate,), tp.rank, tp.world_size),
        }
        self.names = names
        self.act = ACTIVATIONS[act]

    def checkpoint_map(self, prefix: str) -> dict[str, Target]:
        """The Hub layout: `{prefix}.{e}.{gate|up|down}.weight` for each expert e."""
        gate, up, down = self.names
        out: dict[str, Target] = {}
        for e in range(self.num_experts):
            out[f"{prefix}.{e}.{gate}.weight"] = Target(f"{prefix}.gate_up_proj", 0, e)
            out[f"{prefix}.{e}.{up}.weight"] = Target(f"{prefix}.gate_up_proj", 1, e)
            out[f"{prefix}.{e}.{down}.weight"] = Target(f"{prefix}.down_proj", None, e)
        return out

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, H): rows grouped by expert, `counts[e]` rows for expert e -> (N, H)."""
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = x[start : start + n]  # (n, H)
                gate, up = F.linear(rows, self.gate_up_proj[e]).split(self.intermediate, dim=-1)
                out[start : start + n] = F.linear(self.act(gate) * up, self.down_proj[e])
                start += n
        return out


@dataclass(frozen=True)
class GroupLimit:
    """DeepSeek's group_limited_greedy router: the experts form `groups` groups of equal size
    (expert e in group e // (E / groups)); a token picks its top k among the experts of the
    `top_groups` groups whose best expert scores highest."""

    groups: int
    top_groups: int


class SparseMoE(nn.Module):
    """A layer's feed-forward block: route each token to its top_k experts, weight and sum.

    renormalize: divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE's
    `norm_topk_prob`). weights_in_model_dtype: round the routing weights to the activations'
    dtype before weighting (Qwen3-MoE), else weight in float32 and round the product (Mixtral).
    DeepSeek-V2: group_limit (its group_limited_greedy router), routed_scale (its
    routed_scaling_factor, multiplying the weights), router_in_float32 (the router's product
    taken in float32, as transformers keeps that router's weight), shared (the width of its
    shared experts' gated MLP, 0: none) and shared_bias (their biases, `mlp_bias`).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        act: str,
        tp: TensorParallel,
        renormalize: bool,
        weights_in_model_dtype: bool = False,
        expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        group_limit: GroupLimit | None = None,
        routed_scale: float = 1.0,
        router_in_float32: bool = False,
        shared: int = 0,
        shared_bias: bool = False,
    ) -> None:
        super().__init__()
        # Plain nn.Linear, not gemm.Linear: every rank must pick the same experts for a token,
        # so the router's product takes the same form on every rank (gemm's tuned forms are
        # chosen per process by timing and round differently).
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate, act, tp, expert_names)
        self.shared_experts = GatedMLP(hidden, shared, shared_bias, act, tp) if shared else None
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.group_limit = group_limit
        self.routed_scale = routed_scale
        self.router_in_float32 = router_in_float32
        self.tp = tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (weights (T, k) float32, expert ids (T, k))."""
        if self.router_in_float32:
            logits = F.linear(x.float(), self.gate.weight.float())  # (T, E)
        else:
            logits = self.gate(x).float()  # (T, E)
        probs = torch.softmax(logits, dim=-1)  # (T, E)
        if self.group_limit is not None:
            T, limit = probs.shape[0], self.group_limit
            grouped = probs.view(T, limit.groups, -1)  # (T, groups, E / groups)
            best = grouped.amax(dim=-1).topk(limit.top_groups, dim=-1).indices  # (T, top_groups)
            kept = torch.zeros(T, limit.groups, dtype=torch.bool, device=x.device)
            kept.scatter_(1, best, True)
            probs = grouped.masked_fill(~kept[..., None], 0.0).flatten(1)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)  # (T, k) each
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        order = experts.flatten().argsort(stable=True)  # (T * k,) the pairs, by expert
        token = order // self.top_k  # (T * k,) the token of each sorted pair
        counts = torch.bincount(experts.flatten(), minlength=self.experts.num_experts).tolist()
        y = self.experts(x[token], counts)  # (T * k, H)
        y = (y * weights.flatten()[order, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y)  # (T, H): each token's sum
        shared = self.shared_experts
        if shared is None:
            return self.tp.all_reduce(out)
        # The shared experts' partial output (this rank's columns), reduced with the routed sum.
        gate, up = shared.gate_up_proj(x).split(shared.intermediate, dim=-1)
        out += F.linear(shared.act(gate) * up, shared.down_proj.weight)
        out = self.tp.all_reduce(out)
        return out if shared.down_proj.bias is None else out + shared.down_proj.bias


def with_experts(model: CausalLM, dense: dict[str, Target]) -> dict[str, Target]:
    """`dense` (CausalLM.checkpoint_map's default) with each Experts' stacked parameters
    replaced by the per-expert tensors of the Hub layout."""
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    out = {k: t for k, t in dense.items() if t.param.rpartition(".")[0] not in experts}
    for name, module in experts.items():
        out.update(module.checkpoint_map(name))
    return out
