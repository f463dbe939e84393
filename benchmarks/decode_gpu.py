"""Decoder throughput of vlmctl's embedded torch runtime vs transformers on a GPU.

Random fp16 weights with the LLaVA-1.5-7B language model's shape (Llama-2-7B: 32 layers, hidden
4096), made directly on the device, so no checkpoint is needed. Each request: a prompt of
`--prompt-len` tokens of which 576 are image rows from a prompt-embedding table, then
`--new-tokens` greedy tokens. Prints a table; --out writes JSON.

    python benchmarks/decode_gpu.py --batches 1 8 32 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def llama7b_config(layers: int) -> dict:
    return {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": layers,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_act": "silu"}


def random_hf_state(cfg: dict, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float16) * 0.02)

    sd = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, device=device, dtype=torch.float16),
          "lm_head.weight": w(v, h)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{n}.weight"] = w(h, h)
        sd[f"{p}.mlp.gate_proj.weight"] = w(i, h)
        sd[f"{p}.mlp.up_proj.weight"] = w(i, h)
        sd[f"{p}.mlp.down_proj.weight"] = w(h, i)
        sd[f"{p}.input_layernorm.weight"] = torch.ones(h, device=device, dtype=torch.float16)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=torch.float16)
    return sd


def bench_vlmctl(cfg, sd, batch, prompt_len, new_tokens, image_rows=576, graphs=True):
    from vlmctl.runtime.decoder import TorchDecoder
    from vlmctl.runtime.layout import fuse_decoder

    rcfg, weights = fuse_decoder(cfg, dict(sd), None, "float16")
    dec = TorchDecoder({"dtype": "float16", "decoder": rcfg}, weights, device="cuda", max_batch=batch,
                       max_seq=prompt_len + new_tokens + 8)
    dec.use_graphs = graphs
    V = dec.vocab_size
    table = torch.randn(image_rows, cfg["hidden_size"], device="cuda", dtype=torch.float16) * 0.02
    ids = torch.randint(0, V, (prompt_len,), device="cuda")
    ids[1:1 + image_rows] = V + torch.arange(image_rows, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = []
    for s in range(batch):
        first.append(int(dec.prefill(s, ids, table).argmax()))
    torch.cuda.synchronize()
    t_prefill = time.perf_counter() - t0
    # Host-side bookkeeping as the engine keeps it; one device->host copy per step (the sampled ids).
    slots = torch.arange(batch)
    toks = torch.tensor(first)
    lens = torch.full((batch,), prompt_len)
    # warm-up decode steps (kernels, allocator)
    for _ in range(3):
        dec.decode(slots, toks, lens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = dec.decode(slots, toks, lens)
        toks = logits.argmax(-1).cpu()
        lens = lens + 1
    torch.cuda.synchronize()
    t_dec = time.perf_counter() - t0
    del dec
    torch.cuda.empty_cache()
    return {"impl": "vlmctl" if graphs else "vlmctl-eager", "batch": batch, "prefill_s": t_prefill, "decode_ms_per_step": 1000 * t_dec / new_tokens,
            "decode_tok_s": batch * new_tokens / t_dec}


def bench_hf(cfg, sd, batch, prompt_len, new_tokens):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    torch.set_default_dtype(torch.float32)
    model.load_state_dict(sd, strict=False)
    model = model.eval()
    ids = torch.randint(0, cfg["vocab_size"], (batch, prompt_len), device="cuda")
    with torch.inference_mode():
        model.generate(ids[:, :16], max_new_tokens=4, do_sample=False, min_new_tokens=4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens + 1, do_sample=False, min_new_tokens=new_tokens + 1)
        torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
    t_dec = max(t_all - t_prefill, 1e-9)
    del model
    torch.cuda.empty_cache()
    return {"impl": "transformers", "batch": batch, "prefill_s": t_prefill,
            "decode_ms_per_step": 1000 * t_dec / new_tokens, "decode_tok_s": batch * new_tokens / t_dec}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=640)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = llama7b_config(args.layers)
    sd = random_hf_state(cfg, "cuda")
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, layers {args.layers}, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens}")
    print(f"{'impl':<13}{'batch':>6}{'prefill s':>11}{'ms/step':>10}{'tok/s':>10}", flush=True)
    rows = []
    for b in args.batches:
        runs = [lambda: bench_vlmctl(cfg, sd, b, args.prompt_len, args.new_tokens),
                lambda: bench_vlmctl(cfg, sd, b, args.prompt_len, args.new_tokens, graphs=False)]
        if not args.no_hf:
            runs.append(lambda: bench_hf(cfg, sd, b, args.prompt_len, args.new_tokens))
        for run in runs:
            r = run()
            rows.append(r)
            print(f"{r['impl']:<13}{r['batch']:>6}{r['prefill_s']:>11.3f}{r['decode_ms_per_step']:>10.2f}"
                  f"{r['decode_tok_s']:>10.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
