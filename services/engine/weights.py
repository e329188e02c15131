"""Loading safetensors checkpoints into the model, one copy in memory.

The model is built on the meta device, each parameter allocated once in its final dtype and
device, and every checkpoint tensor read from its file straight into (a slice of) its parameter:
no second copy of the weights, no memory map holding file pages. Tensors stored in another dtype
pass through a buffer of one tensor's size.

The model says where each checkpoint tensor goes (`CausalLM.checkpoint_map`: our parameter,
and which part of a fused one) and how each parameter is split between tensor-parallel ranks
(the layers' `splits`, services/engine/models/layers.py); nothing here knows a family. With
tensor parallelism each rank reads only its share of each tensor: rows straight from the file,
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
from services.engine import models
from services.engine.models.base import CausalLM, Target
from services.engine.parallel import TensorParallel

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_HEADER = 100 * 2**20


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
    """Build the model for `cfg` (this rank's share of it, with `tp`) and fill it from the
    checkpoint in `path`."""
    path = Path(path)
    entries = checkpoint_index(path)
    with torch.device("meta"):
        model = models.build(cfg, tp).to(dtype)
    _materialize(model, device)
    model.init_buffers(device)
    for ours, shared in model.tied():
        _set_param(model, ours, model.get_parameter(shared))
    targets = model.checkpoint_map()
    missing = [n for n in targets if n not in entries]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"checkpoint in {path} lacks {', '.join(missing[:3])}{more}")
    staging_ok = device.type == "cpu"
    with torch.no_grad():
        for name, entry in entries.items():
            target = targets.get(name)
            if target is None:
                continue  # not ours: e.g. rotary_emb.inv_freq, or lm_head of a tied model
            for src, columns, dest in _pieces(name, entry, target, model):
                if columns is None and src.dtype == dtype and staging_ok:
                    _read_into(src, dest)
                    continue
                buf = torch.empty(src.shape, dtype=src.dtype)
                _read_into(src, buf)
                dest.copy_(buf if columns is None else buf.narrow(*columns))
    return model.eval()


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer built on the meta device uninitialised storage on
    `device` (what `Module.to_empty` does, without its `empty_like` on meta tensors, whose
    first call imports torch's Python reference decompositions: ~1 s of a worker's start)."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in module.named_buffers(recurse=False):
            module.register_buffer(
                name,
                torch.empty(b.shape, dtype=b.dtype, device=device),
                persistent=name not in module._non_persistent_buffers_set,
            )


def _pieces(
    name: str, entry: TensorEntry, target: Target, model: CausalLM
) -> list[tuple[TensorEntry, tuple[int, int, int] | None, torch.Tensor]]:
    """(what to read of checkpoint tensor `name`, the (dim, start, length) of it to keep when
    the share is not a run of rows (None: all of it), where it goes) for each part it fills.
    Rows are read straight from the file; padding rows of this rank's share are zeroed."""
    param = model.get_parameter(target.param)
    module_name, _, attr = target.param.rpartition(".")
    split = getattr(model.get_submodule(module_name), "splits", {}).get(attr)
    dest = param.data if target.index is None else param.data[target.index]
    if split is None:  # every rank holds all of it
        if list(entry.shape) != list(dest.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {list(entry.shape)}, config.json implies "
                f"{list(dest.shape)}"
            )
        return [(entry, None, dest)]
    parts = range(len(split.parts)) if target.part is None else [target.part]
    expected = list(dest.shape)
    expected[split.dim] = sum(split.parts[p] for p in parts)
    if list(entry.shape) != expected:
        raise ModelLoadError(
            f"tensor {name!r} has shape {list(entry.shape)}, config.json implies {expected}"
        )
    pieces = []
    source_offset = 0
    for p in parts:
        start, length = split.held(p)
        own = dest.narrow(split.dim, split.offset(p), split.per(p))
        if length < split.per(p):  # the vocabulary's padding rows
            own.narrow(split.dim, length, split.per(p) - length).zero_()
        if length:
            at = source_offset + start
            own = own.narrow(split.dim, 0, length)
            if length == entry.shape[split.dim]:  # all of it (tp == 1, one part)
                pieces.append((entry, None, own))
            elif split.dim == 0:
                pieces.append((entry.rows(at, length), None, own))
            else:
                pieces.append((entry, (split.dim, at, length), own))
        source_offset += split.parts[p]
    return pieces


def _set_param(model: CausalLM, name: str, param: torch.nn.Parameter) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, param)


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a Hugging Face checkpoint of this config holds, with their shapes."""
    with torch.device("meta"):
        model = models.build(cfg)
    shapes = {}
    for name, target in model.checkpoint_map().items():
        module_name, _, attr = target.param.rpartition(".")
        split = getattr(model.get_submodule(module_name), "splits", {}).get(attr)
        shape = list(model.get_parameter(target.param).shape)
        if target.index is not None:
            shape = shape[1:]
        if split is not None and target.part is not None:
            shape[split.dim] = split.parts[target.part]
        shapes[name] = tuple(shape)
    return shapes


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
