"""Session 32: tables for two A/Bs, written on the machine for its card.
qkv21.json: the shipped table with Qwen2-VL-7B's qkv (4608x3584) at 2 rows x 4 warps x 1 chunk (the rule's config;
the shipped entry is 4 rows x 4 warps x 2 chunks). gu_rule.json / gu_w2s1.json / gu_w4s1.json / gu_h2.json: no other
entry, and the four gate_up shapes (fused with their act·mul) at the CUDA GEMV's plain rule / 4 rows x 2 warps x 1
chunk / 4 rows x 4 warps x 1 chunk / the half2 Triton GEMV's rule; against VLMCTL_W4A16_TABLE=off, where gate_up
takes the half2 Triton GEMV before session 32's act·mul rule, 4 rows x 2 warps x 1 chunk after it."""
import json, sys
from dataclasses import asdict
import torch
from vlmctl.runtime.kernels import w4a16 as W
out = sys.argv[1]
dev = torch.cuda.get_device_name()
sms = torch.cuda.get_device_properties(0).multi_processor_count
T = json.load(open(W.tuned_table_source()))
qkv = [e for e in T["entries"] if e["device"] == dev and e.get("variant") == "cuda" and (e["n"], e["k"]) == (4608, 3584)
       and e["bucket"] == 1 and e["dtype"] == "float16"]
print("shipped qkv entries", [W.describe(W.Config(**e["config"])) for e in qkv])
assert len(qkv) == 1 and (qkv[0]["config"]["block_n"], qkv[0]["config"]["num_warps"], qkv[0]["config"]["num_stages"]) == (16, 4, 2)
qkv[0]["config"] = {**qkv[0]["config"], "block_n": 8, "num_warps": 4, "num_stages": 1}
json.dump(T, open(f"{out}/qkv21.json", "w"), indent=1)
gate_up = [(22016, 4096), (37888, 3584), (28672, 4096), (27648, 5120)]
def table(cfg_of):
    return {"format": W.FORMAT, "entries": [
        {"device": dev, "bucket": 1, "n": n, "k": k, "group_size": 128, "dtype": "float16", "variant": "cuda",
         "config": asdict(cfg_of(n, k))} for n, k in gate_up]}
rule = lambda n, k: W.heuristic_gemv_cuda_config(n, k, 128, sms)
for n, k in gate_up:
    print(dev, sms, n, k, "rule", W.describe(rule(n, k)))
json.dump(table(rule), open(f"{out}/gu_rule.json", "w"), indent=1)
json.dump(table(lambda n, k: W.Config("gemv_cuda", block_n=8, num_warps=2, num_stages=1)), open(f"{out}/gu_w2s1.json", "w"), indent=1)
json.dump(table(lambda n, k: W.Config("gemv_cuda", block_n=16, num_warps=4, num_stages=1)), open(f"{out}/gu_w4s1.json", "w"), indent=1)
# gu_h2.json: gate_up on the half2 GEMV's rule (what an untabled fused gate_up took before session 32)
h2 = {"format": W.FORMAT, "entries": [
    {"device": dev, "bucket": 1, "n": n, "k": k, "group_size": 128, "dtype": "float16", "variant": "h2",
     "config": asdict(W.heuristic_h2_config(1, n, k, 128, sms))} for n, k in gate_up]}
json.dump(h2, open(f"{out}/gu_h2.json", "w"), indent=1)
# shipped_qwen_gu_h2.json: the shipped table with Qwen2-VL-7B's gate_up on the half2 GEMV's rule where this card's
# table has no CUDA entry for it (the H200): the shipped behaviour before session 32's act·mul rule
S = json.load(open(W.tuned_table_source()))
if not any(e["device"] == dev and e.get("variant") == "cuda" and (e["n"], e["k"]) == (37888, 3584) for e in S["entries"]):
    S["entries"] = [e for e in S["entries"] if not (e["device"] == dev and e.get("variant") == "h2" and (e["n"], e["k"]) == (37888, 3584) and e["dtype"] == "float16" and e["bucket"] == 1)]
    S["entries"].append(h2["entries"][1])
json.dump(S, open(f"{out}/shipped_qwen_gu_h2.json", "w"), indent=1)
