"""What the sampling extras cost an engine step: the same batch decoded plain, with a structured-output
grammar on some or all rows, with penalties, with min_p. One command, on any engine directory:

    python benchmarks/sampling_extras.py ENGINE_DIR [--device cuda] [--batch 8] [--tokens 64] [--json out.json]

Every request decodes exactly `--tokens` tokens: plain and penalized rows ignore EOS; constrained rows
use a json_object grammar with a `maxLength`-free string field, so a model that keeps writing stays
inside the document (a random test model spins in JSON whitespace, which is what makes the mask run on
every step). Reported per case: mean milliseconds per engine step over the decode steps (prefill
excluded: the first step of each run), and tokens/s; the `plain` row is the baseline. On a GPU run
it with a real model's engine: the mask is filled on the host while the logits come from the device.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run_case(engine, prompts, params) -> dict:
    reqs = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    engine.step()  # prefill (and the first token)
    times, tokens = [], 0
    while any(not r.finished for r in reqs):
        t = time.perf_counter()
        evs = engine.step()
        if engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        tokens += len(evs)
    errors = [r.error for r in reqs if r.error]
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    total = sum(times)
    return {"ms_per_step": round(1000 * total / max(len(times), 1), 3), "steps": len(times),
            "tokens_per_s": round(tokens / total, 1) if total else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (vlmctl's default: CPUs - 1)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from vlmctl.host import configure_threads

    configure_threads(args.threads)

    from vlmctl.runtime.engine import Engine, EngineOptions
    from vlmctl.runtime.grammar import GrammarSpec
    from vlmctl.runtime.sampling import SamplingParams

    eng = Engine(args.engine, EngineOptions(device=args.device, max_batch_size=args.batch))
    prompts = [eng.encode([{"role": "user", "content": f"Describe request {i} as JSON."}], [])
               for i in range(args.batch)]
    n = args.tokens
    doc = GrammarSpec.json_schema({"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]})

    def plain(**kw):
        return SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True, **kw)

    def constrained():
        return SamplingParams(max_tokens=n, temperature=0.8, seed=1, grammar=doc)

    b = args.batch
    cases = {
        "plain": [plain() for _ in range(b)],
        "grammar, 1 row": [constrained()] + [plain() for _ in range(b - 1)],
        "grammar, half the rows": [constrained() if i % 2 == 0 else plain() for i in range(b)],
        "grammar, every row": [constrained() for _ in range(b)],
        "penalties, every row": [plain(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
                                 for _ in range(b)],
        "min_p, every row": [plain(min_p=0.05) for _ in range(b)],
    }
    eng.compile_grammar(doc)
    run_case(eng, prompts, cases["plain"])  # warm-up (graph capture, allocator, grammar tokenizer)
    out = {"engine": str(args.engine), "device": str(eng.device), "batch": b, "tokens": n, "cases": {}}
    for name, params in cases.items():
        best = min((run_case(eng, prompts, [p.replace() for p in params]) for _ in range(args.repeats)),
                   key=lambda r: r["ms_per_step"])
        out["cases"][name] = best
        print(f"{name:24s} {best['ms_per_step']:8.3f} ms/step  {best['tokens_per_s']:9.1f} tokens/s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
