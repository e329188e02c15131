"""What every pod of the mesh is built from: the options, the Secrets, the model, probes."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.deploy import objects as k8s
from distserve.deploy.monitoring import scrape_annotations
from distserve.deploy.objects import CONFIG_HASH, HEALTH_PORT
from distserve.deploy.options import RenderOptions
from distserve.deploy.resources import STEP, fixed
from distserve.deploy.secrets import MeshSecrets
from services.common.model_spec import ModelSpec


@dataclass(frozen=True)
class MeshPods:
    """What every pod's builder reads: the options, the Secrets, the model, the config's hash."""

    o: RenderOptions
    secrets: MeshSecrets
    spec: ModelSpec
    mesh_hash: str

    def container(self, name: str, command: list[str], args: list[str], **kw) -> dict:
        return k8s.container(name, self.o.image, self.o.image_pull_policy, command, args, **kw)

    def health(self, grpc_port: int) -> tuple[list[str], k8s.Ports, dict]:
        """A gRPC server's probes: (arguments to add, ports to declare, the probes).

        Kubernetes' gRPC probe against grpc.health.v1: a server listens only once its model and
        KV pool are built, and turns NOT_SERVING when it drains. The kubelet's probe speaks no
        TLS, so under mesh TLS the process also serves the health service alone, in plaintext,
        on HEALTH_PORT (`--health-port`: the same statuses, NOT_SERVING while loading), and
        the probes go there."""
        if self.secrets.mesh_tls is None:
            return [], [], k8s.grpc_probes(grpc_port)
        args = ["--health-port", str(HEALTH_PORT)]
        return args, [("health", HEALTH_PORT)], k8s.grpc_probes(HEALTH_PORT)

    def annotations(self, scraped: bool = True) -> dict[str, str]:
        return {CONFIG_HASH: self.mesh_hash} | (scrape_annotations() if scraped else {})

    def model_pod(
        self, containers: list[dict], volumes: list[dict], tokenizer_only: bool = False
    ) -> dict:
        """A pod that reads the model: its volume, its staging step, the mesh's TLS.
        tokenizer_only: the pod reads no weights (the gateway), so only what it reads is
        staged, into a volume sized for that."""
        # the component's own certificate (its containers[0] is named for it)
        tls_volumes, tls_mounts = self.secrets.mesh_tls_volumes(containers[0]["name"])
        for c in containers:
            c.setdefault("volumeMounts", []).extend([self.o.model.mount(), *tls_mounts])
            c.setdefault("env", []).extend(self.secrets.mesh_tls_env())
        step = self.o.model.staging(
            self.o.image, self.o.image_pull_policy, self.secrets.hf_token_env(), fixed(STEP),
            tokenizer_only=tokenizer_only,
        )  # fmt: skip
        pod: dict = {"initContainers": step} if step else {}
        pod["containers"] = containers
        weights = 0 if tokenizer_only else self.spec.weight_bytes
        pod["volumes"] = [self.o.model.volume(weights), *volumes, *tls_volumes]
        return pod
