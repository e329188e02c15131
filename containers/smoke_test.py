"""The image's smoke test, run by the last stage of containers/Containerfile (`--target test`):
the build fails unless the image serves what it is built to serve.

1. Every container the Kubernetes render puts in a pod (distserve/deploy/render.py, for a
   placement) starts its command from this image: each command answers `--help` with exit 0
   (`python -m services.gateway`, the workers, the planner, `envoy`, ...).
2. The image's default command, `distserve up` (a 1P1D mesh of the embedded tiny model behind
   Envoy), serves a greedy completion through Envoy's HTTP port, and its tokens equal
   transformers' greedy continuation on the same weights (the reference, installed in the test
   stage only), its prompt ids the Hugging Face tokenizer's.

Runs inside a build step: loopback only, ports chosen free, everything stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import torch
import transformers
import yaml

from distserve.deploy.options import DEFAULT_IMAGE
from services.engine.presets import default_model

PROMPT = "Hello mesh, tell me"
MAX_TOKENS = 12
START_TIMEOUT_S = 300


def check_rendered_commands(plan: Path) -> None:
    """Each container the rendered manifests start from this image (DEFAULT_IMAGE; the etcd
    StatefulSet runs etcd's own release image) has its command here."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            ["distserve", "deploy", "render", "--placement", str(plan), "--out", out],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        commands = set()
        for path in Path(out).glob("*.yaml"):
            for doc in yaml.safe_load_all(path.read_text()):
                spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
                for c in spec.get("initContainers", []) + spec.get("containers", []):
                    if c["image"] == DEFAULT_IMAGE:
                        commands.add(tuple(c["command"]))
    if not commands:
        sys.exit(f"the render of {plan} holds no containers")
    for command in sorted(commands):
        done = subprocess.run([*command, "--help"], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"rendered command {' '.join(command)} fails here:\n{done.stderr[-2000:]}")
        print("rendered command runs:", " ".join(command), flush=True)


def check_planner_actuator_imports() -> None:
    """What `--planner-acts` runs in the planner's pod: the Kubernetes client's APIs it calls
    (the image leaves some of the client out: containers/Containerfile)."""
    from kubernetes import client, config  # noqa: F401

    from services.planner.k8s_actuator import KubernetesActuator

    KubernetesActuator(client.ApiClient(), namespace="distserve", gateway="gateway:50051")
    print("the planner's Kubernetes actuator imports and builds", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def serve_one_completion() -> dict:
    """`distserve up` on loopback; one completion through Envoy; the mesh stopped again."""
    edge = _free_port()
    mesh = subprocess.Popen(
        ["distserve", "up", "--host", "127.0.0.1", "--port", "0", "--edge-port", str(edge)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # A mesh that neither serves nor exits is killed, which ends the read below.
    watchdog = threading.Timer(START_TIMEOUT_S, os.killpg, (mesh.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in mesh.stdout:
            print(line, end="", flush=True)
            if "serving" in line:
                break
        else:
            sys.exit(f"distserve up exited or did not serve within {START_TIMEOUT_S} s")
        watchdog.cancel()
        reply = _complete(f"http://127.0.0.1:{edge}/v1")
    finally:
        watchdog.cancel()
        mesh.send_signal(signal.SIGTERM)
        try:
            code = mesh.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(mesh.pid, signal.SIGKILL)
            sys.exit("distserve up did not stop within 90 s of SIGTERM")
    if code != 0:
        sys.exit(f"distserve up exited {code} on SIGTERM")
    return reply


def _complete(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/models", timeout=30) as reply:
        (model,) = (m["id"] for m in json.load(reply)["data"])
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return _post(f"{base}/completions", body)


def reference(folder: Path) -> tuple[list[int], list[int], str]:
    """transformers on the same folder: (prompt ids, greedy continuation, its text)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
    ids = out[0, len(prompt) :].tolist()
    return prompt, ids, tokenizer.decode(ids, skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, required=True, help="a placement to render")
    args = parser.parse_args()
    check_rendered_commands(args.plan)
    check_planner_actuator_imports()
    reply = serve_one_completion()
    (choice,) = reply["choices"]
    prompt, ids, text = reference(default_model("tiny"))
    print("served:", json.dumps({k: choice[k] for k in ("text", "token_ids")}), flush=True)
    print("transformers:", json.dumps({"text": text, "token_ids": ids}), flush=True)
    if choice["prompt_token_ids"] != prompt:
        sys.exit(f"prompt ids {choice['prompt_token_ids']} != transformers' tokenizer's {prompt}")
    if choice["token_ids"] != ids or choice["text"] != text:
        sys.exit("the served completion differs from transformers' greedy continuation")
    print("image smoke test passed: 1P1D mesh through Envoy equals transformers", flush=True)


if __name__ == "__main__":
    main()
