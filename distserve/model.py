"""`distserve model create`: writes a model folder (tiny random weights, or an emulated model's
shape with no weights) to serve or test with. `distserve model fetch`: stages a Hugging Face Hub
model (the files the mesh reads) ahead of time, e.g. in an init container or on a machine with
network for one without."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add `model create` and `model fetch` to a subparsers object."""
    model = sub.add_parser("model", help="create embedded models, fetch Hub models").add_subparsers(
        dest="model_command", required=True
    )
    create = model.add_parser("create", help="write a Hugging Face-format model folder")
    create.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    create.add_argument("--out", required=True, type=Path)
    create.add_argument("--seed", type=int, default=0)
    create.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    create.add_argument(
        "--architecture",
        choices=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"),
        default="LlamaForCausalLM",
    )
    create.add_argument(
        "--emulated",
        metavar="SPEC",
        help="an emulated model's folder instead (no weights): the shape of SPEC (opt-13b, "
        "opt-66b, opt-175b or a model folder), served only by --engine emulated",
    )
    create.set_defaults(func=_model_create)
    fetch = model.add_parser(
        "fetch",
        help="download a Hugging Face Hub model's config, tokenizer and safetensors weights; "
        "prints the folder to pass as --model",
    )
    fetch.add_argument("model_id", metavar="ID", help="Hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    fetch.add_argument(
        "--to",
        type=Path,
        metavar="DIR",
        help="a plain folder to write (default: the Hugging Face cache, HF_HOME)",
    )
    fetch.add_argument("--revision", help="branch, tag or commit (default: main)")
    fetch.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="only what the gateway reads: config, generation config, tokenizer and chat "
        "template files (no weights)",
    )
    fetch.set_defaults(func=_model_fetch)


def _model_create(args: argparse.Namespace) -> int:
    from services.engine.presets import create_emulated, create_model

    if args.emulated:
        from services.common.model_spec import model_spec

        print(create_emulated(model_spec(args.emulated), args.out))
        return 0
    out = create_model(
        args.preset, args.out, seed=args.seed, architecture=args.architecture, dtype=args.dtype
    )
    print(out)
    return 0


def _model_fetch(args: argparse.Namespace) -> int:
    from services.common.errors import InvalidRequest
    from services.common.hub import fetch_model, is_hub_id

    if not is_hub_id(args.model_id):
        raise InvalidRequest(f"{args.model_id!r} is not a Hugging Face Hub id (org/name)")
    folder = fetch_model(
        args.model_id, revision=args.revision, to=args.to, tokenizer_only=args.tokenizer_only
    )
    print(folder)
    return 0
