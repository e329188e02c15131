"""Loading safetensors checkpoints into the model, one copy in memory.

The model is built on the meta device, each parameter allocated once in its final dtype and
device, and every checkpoint tensor read from its file straight into (a slice of) its parameter:
no second copy of the weights, no memory map holding file pages. Tensors stored in another dtype
pass through a buffer of one tensor's size.

With tensor parallelism (`tp`), the model is first rewritten into this rank's shard and each
rank reads only its slice of each checkpoint tensor: rows are read straight from the file,
columns (o_proj, down_proj) through a buffer of one tensor's size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import ModelLoadError
from services.common.model_config import ModelConfig
from services.engine.model import CausalLM
from services.engine.parallel import TensorParallel, shard_model
from services.engine.rope import inverse_frequencies
from services.engine.shards import columns_of, heads_of, kv_heads_of, vocab_rows_of

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_HEADER = 100 * 2**20

# Checkpoint projections that we hold fused: name -> (fused module, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    def rows(self, start: int, n: int) -> TensorEntry:
        """Rows [start, start + n) along the first axis: a contiguous byte range."""
        row = self.nbytes // self.shape[0]
        return TensorEntry(
            self.file, self.dtype, (n, *self.shape[1:]), self.start + start * row, n * row
        )


@dataclass(frozen=True)
class Shard:
    """The slice of a checkpoint tensor one tensor-parallel rank holds: `length` entries from
    `start` along `dim`, of `full`."""

    dim: int
    start: int
    length: int
    full: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and check a safetensors header: every tensor inside the file, sizes consistent."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(f"{file} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelLoadError(f"{file} is corrupt: header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is corrupt: its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file} is corrupt: its header is not a JSON object")
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{file} is corrupt: bad entry for {name!r}") from e
        dtype = _ST_DTYPES.get(dtype_name)
        if dtype is None:
            raise ModelLoadError(
                f"{file}: tensor {name!r} has dtype {dtype_name}; supported: F32, BF16, F16"
            )
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise ModelLoadError(
                f"{file} is corrupt or truncated: tensor {name!r} ({shape}, {dtype_name}) does "
                f"not fit bytes {begin}..{end} of a file of {size} bytes"
            )
        entries[name] = TensorEntry(file, dtype, tuple(shape), data_start + begin, nbytes)
    return entries


def checkpoint_index(path: Path) -> dict[str, TensorEntry]:
    """All tensors of a model folder: model.safetensors or a sharded index."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        return read_header(single)
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is corrupt: {e}") from e
        entries: dict[str, TensorEntry] = {}
        for shard in sorted(set(weight_map.values())):
            file = path / shard
            if not file.exists():
                raise ModelLoadError(f"{index} names {shard}, which is missing from {path}")
            entries.update(read_header(file))
        missing = set(weight_map) - set(entries)
        if missing:
            raise ModelLoadError(f"{index} lists tensors no shard holds: {sorted(missing)[:5]}")
        return entries
    raise ModelLoadError(
        f"no weights in {path}: expected model.safetensors or model.safetensors.index.json"
    )


def _read_into(entry: TensorEntry, dest: torch.Tensor) -> None:
    """Read a tensor's bytes straight into a contiguous CPU tensor of the same dtype."""
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    with entry.file.open("rb", buffering=0) as f:
        f.seek(entry.start)
        done = 0
        while done < entry.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise ModelLoadError(f"{entry.file} ended early: it is truncated")
            done += n


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """Build the model for `cfg` (this rank's shard of it, with `tp`) and fill it from the
    checkpoint in `path`."""
    path = Path(path)
    tp = tp or TensorParallel()
    entries = checkpoint_index(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
        if tp.world_size > 1:
            shard_model(model, tp)
        model = model.to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(device)
    params = dict(model.named_parameters())
    missing = [n for n in checkpoint_names(cfg) if n not in entries]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"checkpoint in {path} lacks {', '.join(missing[:3])}{more}")
    staging_ok = device.type == "cpu"
    for name, entry in entries.items():
        target = _target(name, params, model, tp.world_size)
        if target is None:
            continue  # not ours: e.g. rotary_emb.inv_freq, or lm_head of a tied model
        _, dest = target
        shard = _shard(name, cfg, tp)
        expected = list(dest.shape)
        if shard is not None:
            expected[shard.dim] = shard.full
        if list(entry.shape) != expected:
            raise ModelLoadError(
                f"tensor {name!r} has shape {list(entry.shape)}, config.json implies {expected}"
            )
        with torch.no_grad():
            if shard is not None and dest.shape[shard.dim] > shard.length:  # vocab padding
                dest.narrow(shard.dim, shard.length, dest.shape[shard.dim] - shard.length).zero_()
                dest = dest.narrow(shard.dim, 0, shard.length)
            if shard is not None and shard.dim == 0:
                entry = entry.rows(shard.start, shard.length)
                shard = None
            if shard is None and staging_ok and entry.dtype == dtype:
                _read_into(entry, dest)
            else:
                buf = torch.empty(entry.shape, dtype=entry.dtype)
                _read_into(entry, buf)
                dest.copy_(
                    buf if shard is None else buf.narrow(shard.dim, shard.start, shard.length)
                )
    return model.eval()


def checkpoint_names(cfg: ModelConfig) -> list[str]:
    """The tensor names a Hugging Face checkpoint of this config holds."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
            has_bias = cfg.biases.o if proj == "o_proj" else cfg.biases.qkv
            if has_bias:
                names.append(f"{p}self_attn.{proj}.bias")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{p}mlp.{proj}.weight")
            if cfg.biases.mlp:
                names.append(f"{p}mlp.{proj}.bias")
    return names


def _target(
    name: str, params: dict[str, torch.nn.Parameter], model: CausalLM, tp: int = 1
) -> tuple[str, torch.Tensor] | None:
    """Our parameter (and the rows of it) that checkpoint tensor `name` fills."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        param_name = ".".join([*parts[:-2], fused, parts[-1]])
        param = params.get(param_name)
        if param is None:
            return None
        sizes = _shard_sizes(model, fused, tp)
        start = sum(sizes[:shard])
        return param_name, param.data[start : start + sizes[shard]]
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None
    param = params.get(name)
    return (name, param.data) if param is not None else None


def _shard_sizes(model: CausalLM, fused: str, tp: int = 1) -> list[int]:
    """Rows of each part of a fused projection, on one rank of `tp`."""
    cfg = model.config
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim // tp, cfg.num_kv_heads * cfg.head_dim // tp
        return [q, kv, kv]
    return [cfg.intermediate_size // tp] * 2


def _shard(name: str, cfg: ModelConfig, tp: TensorParallel) -> Shard | None:
    """The slice of checkpoint tensor `name` that rank tp.rank holds; None: all of it."""
    if tp.world_size == 1:
        return None
    r, n, d = tp.rank, tp.world_size, cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = vocab_rows_of(r, n, cfg.vocab_size)
        return Shard(0, rows.start, len(rows), cfg.vocab_size)
    parts = name.split(".")
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if proj == "q_proj":  # column-parallel: this rank's output rows, bias alike
        heads = heads_of(r, n, cfg.num_heads)
        return Shard(0, heads.start * d, len(heads) * d, cfg.num_heads * d)
    if proj in ("k_proj", "v_proj"):
        kv = kv_heads_of(r, n, cfg.num_kv_heads)
        return Shard(0, kv.start * d, len(kv) * d, cfg.num_kv_heads * d)
    if proj in ("gate_proj", "up_proj"):
        cols = columns_of(r, n, cfg.intermediate_size)
        return Shard(0, cols.start, len(cols), cfg.intermediate_size)
    if proj == "o_proj" and kind == "weight":  # row-parallel: input columns; bias replicated
        heads = heads_of(r, n, cfg.num_heads)
        return Shard(1, heads.start * d, len(heads) * d, cfg.num_heads * d)
    if proj == "down_proj" and kind == "weight":
        cols = columns_of(r, n, cfg.intermediate_size)
        return Shard(1, cols.start, len(cols), cfg.intermediate_size)
    return None


def fingerprint(path: Path) -> str:
    """A name of a model folder's weights that changes when they do (for the prefix cache's
    salt): a hash of config.json and of each safetensors file's name, size and modification
    time. Reading the weights themselves would cost seconds per GB at every start."""
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        st = file.stat()
        h.update(f"\x1f{file.name}\x1f{st.st_size}\x1f{st.st_mtime_ns}".encode())
    return h.hexdigest()
