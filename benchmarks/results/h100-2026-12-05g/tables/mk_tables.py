"""Session 31: tables for the rule A/B on an H100. rule.json: the shipped table without its H100 CUDA-GEMV entries
(qkv, o and down then take heuristic_gemv_cuda_config; gate_up, fused with its act·mul, the half2 GEMV);
oldrule.json: the same, with qkv, o and down pinned to the rule before session 31 (4 rows x 4 warps x 2 chunks)."""
import json, sys
src, out = sys.argv[1], sys.argv[2]
T = json.load(open(src))
H = "NVIDIA H100 80GB HBM3"
base = [e for e in T["entries"] if not (e["device"] == H and e.get("variant") == "cuda")]
json.dump({**T, "entries": base}, open(f"{out}/rule.json", "w"), indent=1)
shapes = {(12288, 4096), (4096, 4096), (4096, 11008), (4608, 3584), (3584, 3584), (3584, 18944),
          (6144, 4096), (4096, 14336), (15360, 5120), (5120, 5120), (5120, 13824)}
old = {"kernel": "gemv_cuda", "block_n": 16, "block_k": 0, "block_m": 0, "split_k": 1, "num_warps": 4,
       "num_stages": 2, "run_words": 0, "k_major": False, "warps_m": 1}
pins = [{"device": H, "bucket": 1, "n": n, "k": k, "group_size": 128, "dtype": "float16", "variant": "cuda",
         "config": old} for n, k in sorted(shapes)]
json.dump({**T, "entries": base + pins}, open(f"{out}/oldrule.json", "w"), indent=1)
print(len(T["entries"]), len(base), len(base) + len(pins))
# rule_w4.json: the session-31 rule's rows a warp and chunks in flight, but 4 warps a block (as the rule before)
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402
from dataclasses import asdict  # noqa: E402
w4 = []
for n, k in sorted(shapes):
    c = W.heuristic_gemv_cuda_config(n, k, 128)
    c4 = W.Config("gemv_cuda", block_n=c.block_n * 2, num_warps=4, num_stages=c.num_stages)
    w4.append({"device": H, "bucket": 1, "n": n, "k": k, "group_size": 128, "dtype": "float16", "variant": "cuda",
               "config": asdict(c4)})
    print(n, k, W.describe(c), W.describe(c4))
json.dump({**T, "entries": base + w4}, open(f"{out}/rule_w4.json", "w"), indent=1)
