"""Build the tiny random LLaVA engine that the serving figures in docs/serving.md were measured on.

The checkpoint is the test suite's (tests/tiny_models.py: CLIP 3 layers / hidden 32, Llama 2 layers /
hidden 64, a 200-token BPE vocabulary, random weights), built with the fp32-cpu profile. It says
nothing about model quality; it measures the serving machinery (batching, streaming, HTTP) with a
model small enough that the machinery dominates.

    python benchmarks/tiny_engine.py /tmp/vlmctl-tiny        # -> /tmp/vlmctl-tiny/engine
    vlmctl bench /tmp/vlmctl-tiny/engine -n 64 -c 1 -c 16 --max-batch-size 16 --output-len 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="Directory for the checkpoint, recipe and engine")
    ap.add_argument("--max-batch-size", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import yaml
    from tiny_models import make_llava

    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_llava(out / "ckpt")
    recipe = out / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"name": "tiny-llava", "source": str(ckpt), "profiles": ["fp32-cpu"],
                                      "limits": {"max_batch_size": args.max_batch_size}}))
    build(load_recipe(recipe), out / "engine")
    print(out / "engine")


if __name__ == "__main__":
    main()
