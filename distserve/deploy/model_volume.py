"""Where the pods find the model: a volume mounted at /models, and optionally a step that stages
a Hugging Face Hub model into it.

- A PersistentVolumeClaim (`--model-pvc`, default `distserve-models`) or a folder of every node
  (`--model-host-path`) that already holds the model folder: mounted read-only.
- `--model ORG/NAME` (a Hub id): every pod that reads the model first runs an init container,
  `distserve model fetch ORG/NAME --to /models/<model-path>` (the gateway's with
  `--tokenizer-only`: it reads no weights), with HF_TOKEN from its Secret when one is given.
  Into an emptyDir sized for what it fetches (each pod downloads its own copy), or into
  `--model-pvc` when given (a
  ReadWriteMany claim: the first pod downloads, the others find the files there; a restarted pod
  finds them too). The serving containers mount the volume read-only either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidRequest

MODEL_MOUNT = "/models"
DEFAULT_MODEL_PVC = "distserve-models"
GIB = 2**30


@dataclass(frozen=True)
class ModelSource:
    """The model volume's options (module docstring)."""

    path: str = "model"  # the model folder, relative to the volume's root
    hub_id: str | None = None  # stage this Hub model into the volume first
    revision: str | None = None  # with hub_id: a branch, tag or commit
    pvc: str | None = None  # a PersistentVolumeClaim (default: DEFAULT_MODEL_PVC)
    host_path: str | None = None  # instead of a claim: this folder on every node

    def __post_init__(self) -> None:
        parts = Path(self.path).parts
        if not parts or Path(self.path).is_absolute() or ".." in parts:
            raise InvalidRequest(f"model path {self.path!r} must be relative to the volume")
        if self.hub_id is not None:
            from services.common.hub import is_hub_id

            if not is_hub_id(self.hub_id):
                raise InvalidRequest(f"--model {self.hub_id!r} is not a Hub id (org/name)")
            if self.host_path is not None:
                raise InvalidRequest(
                    "--model stages into a pod's volume; --model-host-path is a node's folder "
                    "mounted read-only: give one of them (or --model-pvc to stage into a claim)"
                )
        elif self.revision is not None:
            raise InvalidRequest("--revision goes with --model (a Hub id)")
        if self.pvc is not None and self.host_path is not None:
            raise InvalidRequest("give --model-pvc or --model-host-path, not both")

    @property
    def folder(self) -> str:
        """The model folder as the containers see it."""
        return f"{MODEL_MOUNT}/{Path(self.path).as_posix()}"

    def volume(self, weight_bytes: int) -> dict:
        """The pod's `model` volume; an emptyDir for a staged model holds its weights (in their
        stored dtype; 0 for a pod that stages no weights) plus a tenth for the tokenizer,
        configs and the download's own files, and at least 1 GiB."""
        if self.host_path is not None:
            return {"name": "model", "hostPath": {"path": self.host_path, "type": "Directory"}}
        if self.hub_id is not None and self.pvc is None:
            size = math.ceil(weight_bytes * 1.1 / GIB)
            return {"name": "model", "emptyDir": {"sizeLimit": f"{max(size, 1)}Gi"}}
        claim: dict = {"claimName": self.pvc or DEFAULT_MODEL_PVC}
        if self.hub_id is None:
            claim["readOnly"] = True
        return {"name": "model", "persistentVolumeClaim": claim}

    def mount(self) -> dict:
        return {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}

    def staging(
        self,
        image: str,
        pull_policy: str,
        env: list[dict],
        resources: dict,
        tokenizer_only: bool = False,
    ) -> list[dict]:
        """The init containers of a pod that reads the model: `distserve model fetch` for a Hub
        id (`--tokenizer-only` for a pod that reads no weights), none otherwise. `env`:
        HF_TOKEN from its Secret, when there is one."""
        if self.hub_id is None:
            return []
        args = ["model", "fetch", self.hub_id, "--to", self.folder]
        args += ["--revision", self.revision] if self.revision else []
        args += ["--tokenizer-only"] if tokenizer_only else []
        step: dict = {
            "name": "stage-model",
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": ["python", "-m", "distserve.cli"],
            "args": args,
        }
        if env:
            step["env"] = env
        step["resources"] = resources
        step["volumeMounts"] = [{"name": "model", "mountPath": MODEL_MOUNT}]
        return [step]
