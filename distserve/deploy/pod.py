"""What every pod of the mesh is built from: the options, the Secrets, the model, probes."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.deploy import objects as k8s
from distserve.deploy.monitoring import scrape_annotations
from distserve.deploy.objects import CONFIG_HASH, METRICS_PORT, PLANNER_PORT
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

    def probes(self, port: int) -> dict:
        """grpc.health.v1 on the gRPC port: a server listens only once its model and KV pool
        are built, and turns NOT_SERVING when it drains. The kubelet's gRPC probe speaks no
        TLS, so under mesh TLS the closest signal is /metrics (served once the model and KV
        pool are built, by the same process), or the port accepting connections."""
        if self.secrets.mesh_tls is None:
            return k8s.grpc_probes(port)
        if port == PLANNER_PORT:  # the planner serves no metrics
            return k8s.probes({"tcpSocket": {"port": port}})
        return k8s.probes({"httpGet": {"path": "/metrics", "port": METRICS_PORT}})

    def annotations(self, scraped: bool = True) -> dict[str, str]:
        return {CONFIG_HASH: self.mesh_hash} | (scrape_annotations() if scraped else {})

    def model_pod(self, containers: list[dict], volumes: list[dict]) -> dict:
        """A pod that reads the model: its volume, its staging step, the mesh's TLS."""
        tls_volumes, tls_mounts = self.secrets.mesh_tls_volumes()
        for c in containers:
            c.setdefault("volumeMounts", []).extend([self.o.model.mount(), *tls_mounts])
            c.setdefault("env", []).extend(self.secrets.mesh_tls_env())
        step = self.o.model.staging(
            self.o.image, self.o.image_pull_policy, self.secrets.hf_token_env(), fixed(STEP)
        )
        pod: dict = {"initContainers": step} if step else {}
        pod["containers"] = containers
        pod["volumes"] = [self.o.model.volume(self.spec.weight_bytes), *volumes, *tls_volumes]
        return pod
