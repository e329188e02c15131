"""Decode and prefill speed of the engine on a CUDA device (run by bench/gpu_check.sh).

Small preset; prefill of one 2048-token prompt; decode step at batch 1, 8, 32 and 128 with
prompts uniform in [64, 1024]; float32 and bfloat16. Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import default_model


def decode_steps(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[float]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.waiting:
        engine.step()
    steps = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
    return steps[:-1]


def main() -> None:
    path = default_model("small")
    gen = torch.Generator().manual_seed(0)
    result = {"bench": "engine_gpu", "gpu": torch.cuda.get_device_name(), "rows": []}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(path, EngineConfig(device="cuda", dtype=dtype, max_num_seqs=128))
        prompt = torch.randint(2, 900, (2048,), generator=gen).tolist()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.generate([prompt], params)  # warm-up
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate([prompt], params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        row = {"dtype": dtype, "prefill_2048_tok_s": round(2048 / statistics.median(times))}
        for b in (1, 8, 32, 128):
            lengths = torch.randint(64, 1025, (b,), generator=gen).tolist()
            prompts = [torch.randint(2, 900, (n,), generator=gen).tolist() for n in lengths]
            step = statistics.median(decode_steps(engine, prompts, 32))
            row[f"decode_b{b}_step_ms"] = round(step * 1e3, 3)
            row[f"decode_b{b}_tok_s"] = round(b / step, 1)
        print(row, flush=True)
        result["rows"].append(row)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
