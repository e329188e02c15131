"""The KV memory the data plane moves: an engine's cache or a buffer like it, which is a numpy
array (host memory: an emulated engine's, whose process never imports torch) or a torch tensor
(the real engine's: host or device memory).

Each function here works on either, and touches torch only when it is given a tensor (torch is
then imported already): numpy arrays keep a process free of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def on_host(a: Any) -> bool:
    """Whether an array is in host memory: a numpy array, or a torch tensor on the CPU."""
    return isinstance(a, np.ndarray) or a.device.type == "cpu"


def raw(a: Any) -> Any:
    """A contiguous array's bytes for a transport: a numpy uint8 view in host memory (buffer
    protocol), a uint8 tensor in device memory (CUDA array interface). No copy either way."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    import torch

    b = a.reshape(-1).view(torch.uint8)
    return b.numpy() if b.device.type == "cpu" else b


def contiguous(a: Any) -> Any:
    """An array's elements laid out contiguously (a copy if they are not already)."""
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a.contiguous()


def empty(shape: tuple[int, ...], dtype: str, like: Any) -> Any:
    """An uninitialised array of `shape` and `dtype` (a name: "float32", "bfloat16",
    "float16"), of the same library and in the same memory as `like`."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, np.dtype(dtype))
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)


def empty_like(a: Any) -> Any:
    """An uninitialised contiguous array of `a`'s shape and dtype, in the same memory."""
    if isinstance(a, np.ndarray):
        return np.empty(a.shape, a.dtype)
    import torch

    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


def copy_into(dst: Any, src: Any) -> None:
    """Copy `src` into `dst`, an array of the same library and shape (a view of a cache)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def dtype_name(dtype: Any) -> str:
    """A torch or numpy dtype's name, as a KV handle gives it: "float32", "bfloat16"..."""
    return str(dtype).removeprefix("torch.")
