"""Session 31: V1 = the rule before, with LLaVA-1.5-13B's o and down at 2 rows x 4 warps x 1 chunk; V3 = V1 with
Qwen2-VL-7B's qkv at 2 rows x 4 warps x 2 chunks. (V0 = oldrule.json, V2 = rule_w4.json, from mk_tables.py.)"""
import json, sys
out = sys.argv[1]
T = json.load(open(f"{out}/oldrule.json"))
def pin(T, shapes, bn, w, s):
    for e in T["entries"]:
        if e.get("variant") == "cuda" and e["device"].startswith("NVIDIA H100") and (e["n"], e["k"]) in shapes:
            e["config"] = {**e["config"], "block_n": bn, "num_warps": w, "num_stages": s}
pin(T, {(5120, 5120), (5120, 13824)}, 8, 4, 1)
json.dump(T, open(f"{out}/v1.json", "w"), indent=1)
pin(T, {(4608, 3584)}, 8, 4, 2)
json.dump(T, open(f"{out}/v3.json", "w"), indent=1)
