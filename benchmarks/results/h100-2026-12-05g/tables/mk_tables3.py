"""Session 31: tqm.json = the shipped table with Qwen2-VL-7B's and Mistral-7B's qkv entries (H100) at 4 rows x 4 warps
x 2 chunks."""
import json, sys
src, out = sys.argv[1], sys.argv[2]
T = json.load(open(src))
n = 0
for e in T["entries"]:
    if e.get("variant") == "cuda" and e["device"].startswith("NVIDIA H100") and (e["n"], e["k"]) in {(4608, 3584), (6144, 4096)}:
        e["config"] = {**e["config"], "block_n": 16, "num_warps": 4, "num_stages": 2}
        n += 1
assert n == 2
json.dump(T, open(f"{out}/tqm.json", "w"), indent=1)
