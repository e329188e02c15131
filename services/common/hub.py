"""`--model`: a model folder on this machine, or a Hugging Face Hub id resolved to one.

A Hub id (`org/name`, at an optional `--revision`) is fetched with huggingface_hub's
`snapshot_download` into its cache (or a folder of the caller's choosing), and only the files
the mesh reads (MODEL_FILES): config.json, generation_config.json, the tokenizer and chat
template files and the safetensors weights; never .bin/.pt/.h5/ONNX/GGUF copies of the same
weights. `tokenizer_only` fetches TOKENIZER_FILES alone: what the gateway reads (it never
loads weights), so its pod stages kilobytes rather than the model. huggingface_hub's own
environment is honoured, and never set here: HF_TOKEN (gated and
private models), HF_HOME / HF_HUB_CACHE (where the cache lives), HF_HUB_OFFLINE=1 (cache only,
no network), HF_ENDPOINT (a mirror).

`distserve up` resolves the id once and hands every process the same folder, so workers never
race each other's downloads; `distserve model fetch` stages a model ahead of time (an init
container, a machine without network later).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from services.common.errors import DistServeError, InvalidRequest, ModelLoadError

T = TypeVar("T")

# What the gateway reads of a model folder (services/gateway/__main__.py's serve): the shape and
# limits (config.json; generation_config.json's end-of-sequence ids and sampling defaults), the
# tokenizer (tokenizer.json; tokenizer_config.json's special tokens and chat template) and the
# chat template file.
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
# What snapshot_download fetches: all the mesh reads of a model, and nothing else. The weights
# are transformers' safetensors (model.safetensors, or shards and their index): not the same
# weights again as .bin/.pt/.h5/ONNX/GGUF, nor another tool's copy (Mistral's
# consolidated.safetensors, an original/ folder).
MODEL_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
)

_STAGE = (
    "stage it on a machine with network (`distserve model fetch {id} --to DIR`, or with "
    "HF_HOME pointing at a cache this machine shares) and pass the folder as --model"
)


def resolve_model(model: str | Path, revision: str | None = None) -> Path:
    """The local folder of `model`: the folder itself when it exists here, else the snapshot
    of the Hub id `model` at `revision` (default: main), downloaded if not cached.

    ModelLoadError when neither: the message names the id and says whether the Hub refused it
    or could not be reached (offline), and how to stage the model."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise InvalidRequest(
                f"--revision {revision} is for a Hugging Face Hub id; {model} is a local folder"
            )
        return folder
    name = str(model)
    if not is_hub_id(name):
        raise ModelLoadError(f"model folder {name} does not exist")
    return fetch_model(name, revision=revision)


def with_local_model(config: T, revision: str | None = None) -> T:
    """A service's config (a dataclass with a `model`) with that model a local folder: what a
    process's main does after parsing its command line (parsing does no I/O: `distserve up`
    checks options with the parsers)."""
    return dataclasses.replace(config, model=resolve_model(config.model, revision))


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled as a Hub repository id (`name` or `org/name`), not a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def fetch_model(
    repo_id: str,
    *,
    revision: str | None = None,
    to: Path | None = None,
    tokenizer_only: bool = False,
) -> Path:
    """Download (or find in the cache) MODEL_FILES of `repo_id` at `revision`, or TOKENIZER_FILES
    alone with `tokenizer_only`; returns the folder: the cache's snapshot folder, or `to` when
    given (a plain copy, no cache layout)."""
    import huggingface_hub
    from huggingface_hub import errors

    where = repo_id if revision is None else f"{repo_id} at revision {revision}"
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(TOKENIZER_FILES if tokenizer_only else MODEL_FILES),
            local_dir=to,
        )
    except errors.GatedRepoError as e:
        raise ModelLoadError(
            f"{where} is gated on the Hugging Face Hub: accept its terms on the model's page "
            "and set HF_TOKEN to a token of that account"
        ) from e
    except errors.RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"{where} is neither a model folder here nor a model on the Hugging Face Hub "
            "(a private one needs HF_TOKEN)"
        ) from e
    except errors.RevisionNotFoundError as e:
        raise ModelLoadError(
            f"the Hugging Face Hub has no revision {revision!r} of {repo_id}"
        ) from e
    except errors.LocalEntryNotFoundError as e:
        # Offline (HF_HUB_OFFLINE=1) or the Hub unreachable, and the cache lacks the model, or
        # (huggingface_hub >= 1.0's IncompleteSnapshotError, which knows its snapshot) holds
        # only some of its files, e.g. a tokenizer fetched alone.
        if getattr(e, "snapshot_path", None):
            raise ModelLoadError(
                f"the Hugging Face cache holds only part of {where}, and the Hub is offline or "
                f"unreachable ({_offline_reason()}): {' '.join(str(e).split())}; "
                + _STAGE.format(id=repo_id)
            ) from e
        raise ModelLoadError(
            f"{where} is not a model folder here and not in the Hugging Face cache, and the Hub "
            f"is offline or unreachable ({_offline_reason()}); " + _STAGE.format(id=repo_id)
        ) from e
    except errors.HfHubHTTPError as e:
        raise ModelLoadError(f"the Hugging Face Hub refused {where}: {e}") from e
    except OSError as e:  # the cache or `to` cannot be written
        raise ModelLoadError(f"{where} could not be stored: {e}") from e
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise ModelLoadError(
            f"{where} has no config.json at the top of its repository: not a Hugging Face "
            "transformers model the mesh can serve"
        )
    return folder


def _offline_reason() -> str:
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "no connection"


@contextmanager
def refuse_at_start(service: str) -> Iterator[None]:
    """Around a process's start-up: a model it cannot serve (a missing folder, an unknown Hub
    id, no tokenizer, a quantised checkpoint ...) ends it with one line naming the reason and
    exit status 2, rather than a traceback."""
    try:
        yield
    except DistServeError as e:
        print(f"{service}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
