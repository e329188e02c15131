"""Which share of a model each rank of a tensor-parallel group holds: its query heads, KV heads,
MLP columns and vocabulary rows.

Plain arithmetic, without torch: the workers size their KV data planes with it, and an emulated
engine (whose process never imports torch) checks its model's shape with it. The model's
rewrite into one rank's shard is services/engine/parallel.py.
"""

from __future__ import annotations

from services.common.errors import InvalidRequest, UnsupportedModel
from services.common.model_config import ModelConfig


def check_rank(rank: int, tp: int) -> None:
    """Raise InvalidRequest unless `rank` is a rank of a group of `tp`."""
    if tp < 1 or not 0 <= rank < tp:
        raise InvalidRequest(
            f"tensor parallel rank {rank} of {tp}: need tp >= 1 and 0 <= rank < tp"
        )


def _part(rank: int, tp: int, n: int, what: str) -> range:
    if n % tp:
        raise UnsupportedModel(
            f"tensor parallelism tp={tp} does not divide {what} ({n}); choose a tp that divides "
            "num_attention_heads, num_key_value_heads and intermediate_size (replicating KV "
            "heads for tp > num_key_value_heads is not implemented)"
        )
    per = n // tp
    return range(rank * per, (rank + 1) * per)


def kv_heads_of(rank: int, tp: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` of `tp` holds (computes and caches): a contiguous range."""
    check_rank(rank, tp)
    return _part(rank, tp, num_kv_heads, "num_key_value_heads")


def heads_of(rank: int, tp: int, num_heads: int) -> range:
    """The query heads rank `rank` of `tp` holds."""
    check_rank(rank, tp)
    return _part(rank, tp, num_heads, "num_attention_heads")


def columns_of(rank: int, tp: int, intermediate_size: int) -> range:
    """The MLP columns (of gate and of up; rows of down's input) rank `rank` of `tp` holds."""
    check_rank(rank, tp)
    return _part(rank, tp, intermediate_size, "intermediate_size")


def vocab_rows_of(rank: int, tp: int, vocab_size: int) -> range:
    """The vocabulary rows rank `rank` holds: ceil(vocab / tp) a rank, the last ones fewer."""
    per = -(-vocab_size // tp)
    return range(min(rank * per, vocab_size), min((rank + 1) * per, vocab_size))


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise UnsupportedModel unless `tp` divides the heads, the KV heads (a latent KV is held
    whole by every rank) and the MLP width."""
    shares = [(cfg.num_heads, "num_attention_heads"), (cfg.intermediate_size, "intermediate_size")]
    if not cfg.kv_latent:
        shares.append((cfg.num_kv_heads, "num_key_value_heads"))
    for n, what in shares:
        _part(0, tp, n, what)
