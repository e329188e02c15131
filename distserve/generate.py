"""`distserve generate` and `distserve chat`: the engine in this process, no mesh: one prompt,
or one per line, streamed as it decodes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from services.common.errors import DistServeError


def register(sub: argparse._SubParsersAction) -> None:
    """Add `generate` and `chat` to a subparsers object."""
    gen = sub.add_parser("generate", help="run the engine in-process on one prompt")
    _add_engine_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="interactive: one prompt per line, streamed answers")
    _add_engine_args(chat)
    chat.set_defaults(func=_chat)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="model folder (default: the embedded tiny model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")


def _engine(args: argparse.Namespace):
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.presets import default_model

    model_dir = args.model or default_model("tiny")
    return LLMEngine(model_dir, EngineConfig(device=args.device, dtype=args.dtype))


def _params(args: argparse.Namespace):
    from services.common.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _stream(engine, prompt: str, params, out) -> dict:
    """Run one request, writing text deltas to `out` as they come; returns the summary."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    prompt_tokens = engine.sequence(rid).num_prompt_tokens
    token_ids: list[int] = []
    text = []
    first = None
    reason = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id != rid:
                continue
            first = first or time.perf_counter()
            token_ids += o.new_token_ids
            text.append(o.text_delta)
            if out is not None and o.text_delta:
                out.write(o.text_delta)
                out.flush()
            if o.finished:
                reason = o.finish_reason
    end = time.perf_counter()
    return {
        "token_ids": token_ids,
        "text": "".join(text),
        "finish_reason": str(reason),
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids)},
        "ttft_ms": round(((first or end) - start) * 1000, 3),
        "latency_ms": round((end - start) * 1000, 3),
    }


def _generate(args: argparse.Namespace) -> int:
    params = _params(args)
    engine = _engine(args)
    result = _stream(engine, args.prompt, params, None if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    else:
        print()
    return 0


def _chat(args: argparse.Namespace) -> int:
    params = _params(args)
    engine = _engine(args)
    print(
        f"distserve: model {engine.model_dir} on {engine.device}; one prompt per line, Ctrl-D ends"
    )
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        if not prompt:
            continue
        try:
            _stream(engine, prompt, params, sys.stdout)
        except DistServeError as e:
            print(f"error: {e}", end="")
        print(flush=True)
    return 0
