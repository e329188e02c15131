"""The sampling defaults a model folder's generation_config.json sets (vLLM's
`--generation-config auto`), read and checked once at the gateway, without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ModelLoadError


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a model's generation_config.json sets, applied to a request that
    gives none of its own (as vLLM's `--generation-config auto`); None: not set."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # its max_new_tokens
    repetition_penalty: float | None = None
    min_p: float | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> GenerationDefaults:
        """Read generation_config.json of a model folder (none: no defaults). A value of the
        wrong type or range is a ModelLoadError naming it: every request would inherit it."""
        file = Path(path) / "generation_config.json"
        if not file.exists():
            return cls()
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{file} must hold a JSON object")
        # As vLLM: the values set are the defaults, do_sample aside.
        out = cls(
            temperature=_number(raw, "temperature", file),
            top_p=_number(raw, "top_p", file),
            top_k=_integer(raw, "top_k", file),
            repetition_penalty=_number(raw, "repetition_penalty", file),
            min_p=_number(raw, "min_p", file),
            max_tokens=_integer(raw, "max_new_tokens", file),
        )
        if out.temperature is not None and out.temperature < 0:
            raise ModelLoadError(f"{file}: temperature must be >= 0, got {out.temperature}")
        if out.top_p is not None and not 0 < out.top_p <= 1:
            raise ModelLoadError(f"{file}: top_p must be in (0, 1], got {out.top_p}")
        if out.top_k is not None and out.top_k < 0:
            raise ModelLoadError(f"{file}: top_k must be >= 0, got {out.top_k}")
        if out.repetition_penalty is not None and out.repetition_penalty <= 0:
            raise ModelLoadError(
                f"{file}: repetition_penalty must be > 0, got {out.repetition_penalty}"
            )
        if out.min_p is not None and not 0 <= out.min_p <= 1:
            raise ModelLoadError(f"{file}: min_p must be in [0, 1], got {out.min_p}")
        if out.max_tokens is not None and out.max_tokens < 1:
            raise ModelLoadError(f"{file}: max_new_tokens must be >= 1, got {out.max_tokens}")
        return out


def _number(raw: dict, key: str, file: Path) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{file}: {key} must be a number, got {value!r}")
    return float(value)


def _integer(raw: dict, key: str, file: Path) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{file}: {key} must be an integer, got {value!r}")
    return value
