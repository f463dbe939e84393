"""End-to-end serving figures on a GPU: a LLaVA-1.5-7B-shaped engine made by `vlmctl build`,
run with the engine's default settings (recipe defaults except `limits.max_batch_size: 64`).

The checkpoint has LLaVA-1.5-7B's shapes (CLIP ViT-L/14-336 + 2-layer projector + Llama-2-7B, fp16)
and random weights, made on the device (the tokenizer is the test suite's small BPE, so a prompt
of 9 random words is ~60 tokens). Measured, all in one process:

- engine load time and GPU memory; the vision backend chosen;
- TTFT of one request (one 336 px image + the text), median of 5, with the vision and prefill parts;
- `vlmctl bench`'s engine run: -n 256 -c 64, 1 image, 128 output tokens (output tok/s, TTFT, TPOT);
- a burst of 64 such requests at once (TTFT p50/p99);
- 32 running streams while a burst of 64 is admitted: their inter-token gaps and TPOT, p50 vs p99;
- transformers' LlavaForConditionalGeneration.generate on the same checkpoint: TTFT and batch-64 tok/s;
- with --awq: an AWQ engine (round-to-nearest int4 of the same decoder, group 128) and its load
  time, weight memory and decode throughput.

    python benchmarks/serving_gpu.py --work /var/tmp/vlmctl-bench [--awq] [--out results.json]
    python benchmarks/serving_gpu.py --smoke --work /tmp/smoke      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SEVEN_B = dict(vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                           image_size=336, patch_size=14, projection_dim=768),
               text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096),
               image=336)
SMOKE = dict(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         image_size=28, patch_size=7, projection_dim=32),
             text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=300, max_position_embeddings=4096),
             image=28)


def log(*a):
    print(*a, flush=True)


def make_checkpoint(out: Path, shape: dict, device: str) -> Path:
    from tiny_models import LLAVA_CHAT_TEMPLATE, make_tokenizer
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    if (out / "config.json").exists():
        return out
    tok = make_tokenizer(["<image>"])
    vc = CLIPVisionConfig(**shape["vision"])
    tc = LlamaConfig(**shape["text"], rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, initializer_range=0.02)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlavaForConditionalGeneration(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    s = shape["image"]
    ip = CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
    LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=shape["vision"]["patch_size"],
                   vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                   image_token="<image>", num_additional_image_tokens=1).save_pretrained(out)
    del model
    return out


def build_engine(ckpt: Path, work: Path, dtype: str) -> tuple[Path, float]:
    import yaml

    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    recipe = work / "llava7b.yaml"
    recipe.write_text(yaml.safe_dump({"name": "llava-1.5-7b-shaped", "source": str(ckpt),
                                      "profiles": ["fp16" if dtype == "float16" else "fp32-cpu"],
                                      "limits": {"max_batch_size": 64}}))
    t0 = time.perf_counter()
    build(load_recipe(recipe), work / "engine")
    return work / "engine", time.perf_counter() - t0


def make_awq_engine(engine: Path, work: Path, group: int) -> Path:
    """The same engine with its decoder round-to-nearest quantized to AutoAWQ GEMM int4 (no calibration:
    the arithmetic, not the quality, is measured), built by the torch backend's build-llm."""
    from vlmctl.export.torch_decoder import build_torch_decoder
    from vlmctl.formats.torch_layout import read_layout
    from vlmctl.formats.awq_gemm import pack_gemm

    out = work / "engine-awq"
    if (out / "build-llm" / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for part in ("convert", "export-vision", "build-vision"):
        (out / part).symlink_to((engine / part).resolve())
    src = engine / "convert" / "llm"
    qdir = work / "awq-llm"
    qdir.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    (qdir / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    from vlmctl.checkpoint import iter_tensors

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tensors = {}
    for name, t, _ in iter_tensors(src):
        if name.endswith(".weight") and ".layers." in name and t.dim() == 2:
            w = t.to(dev, torch.float32)
            out_f, in_f = w.shape
            g = w.view(out_f, in_f // group, group)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = ((hi - lo).clamp_min(1e-5) / 15)
            zero = (-lo / scale).round().clamp(0, 15)
            codes = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).view(out_f, in_f)
            qw, qz = pack_gemm(codes.to(torch.int32), zero.to(torch.int32))
            base = name[:-len(".weight")]
            tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"] = qw.cpu(), qz.cpu()
            tensors[f"{base}.scales"] = scale.t().contiguous().half().cpu()
        else:
            tensors[name] = t
    save_file(tensors, str(qdir / "model.safetensors"))
    layout = read_layout(engine / "build-llm")
    build_torch_decoder(qdir, out / "build-llm", engine_root=out, dtype=layout.dtype, extra_config=layout.extra)
    (out / "build-llm" / "manifest.json").write_text(json.dumps({"stage": "build-llm", "files": []}))
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_profile(prof, wall_s: float, prefill_tokens: int, top: int = 10) -> dict:
    """One profiled forward: wall time against the sum of its GPU kernels (is it the GPU or the host
    that is slow?), its costliest kernels and host ops."""
    from torch.autograd import DeviceType

    dev, cpu = [], []
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            dev.append((e.key, getattr(e, "self_device_time_total", 0), e.count))
        elif e.self_cpu_time_total:
            cpu.append((e.key, e.self_cpu_time_total, e.count))
    dev.sort(key=lambda r: -r[1])
    cpu.sort(key=lambda r: -r[1])
    return {"wall_ms": round(1000 * wall_s, 2), "prefill_tokens": prefill_tokens,
            "kernels_ms": round(sum(r[1] for r in dev) / 1000, 2), "kernel_count": sum(r[2] for r in dev),
            "top_kernels_us_count": [(k[:90], round(t), c) for k, t, c in dev[:top]],
            "top_host_ops_us_count": [(k[:60], round(t), c) for k, t, c in cpu[:top]]}


class StepLog:
    """Wraps `eng.step` while active: each step's wall time, prefill tokens and running requests, the
    time of its vision and forward phases (each synchronized, so the GPU time lands in the phase that
    queued it; this costs a little throughput), plus the CUDA caching allocator's counters, to say
    where a slow bench run's extra time goes."""

    def __init__(self, eng, profile_prefills: int = 0, profile_min_tokens: int = 1500):
        self.eng, self.rows, self._orig = eng, [], None
        self.compiles, self._watch = [], None  # (step index, Triton kernel compiled in it)
        self.profile_prefills, self.profile_min_tokens, self.profiles = profile_prefills, profile_min_tokens, []
        self._gc = {"collections": 0, "s": 0.0}

    def __enter__(self):
        eng = self.eng
        self._orig = {name: getattr(eng, name) for name in ("step", "_prepare_images", "_run")}
        self._mem0 = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        phase = {}

        def timed_phase(name):
            fn = self._orig[name]

            def run(*a):
                sync()  # attribute the GPU time to the phase that queued it
                prof = None
                if (name == "_run" and len(self.profiles) < self.profile_prefills
                        and sum(s.n for s in a[0] if s.n > 1) >= self.profile_min_tokens):
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                t = time.perf_counter()
                out = fn(*a)
                sync()
                dt = time.perf_counter() - t
                phase[name] = phase.get(name, 0.0) + dt
                if prof is not None:
                    prof.__exit__(None, None, None)
                    self.profiles.append(kernel_profile(prof, dt, sum(s.n for s in a[0] if s.n > 1)))
                return out
            return run

        def on_gc(stage, info):  # is a slow step a cyclic-GC pause?
            if stage == "start":
                self._gc["t"] = time.perf_counter()
            elif "t" in self._gc:
                self._gc["collections"] += 1
                self._gc["s"] += time.perf_counter() - self._gc.pop("t")

        self._on_gc = on_gc
        gc.callbacks.append(on_gc)
        from vlmctl.runtime.kernels import triton_watch

        seen = []
        if triton_watch.available():  # a step that compiles a Triton kernel stalls 0.1-0.5 s
            self._watch = triton_watch.triton_compiles()
            seen = self._watch.__enter__()

        def timed():
            sched = eng.scheduler
            before = {id(r): r.num_computed for r in sched.running} if sched is not None else {}
            phase.clear()
            n_seen = len(seen)
            t = time.perf_counter()
            out = self._orig["step"]()
            dt = time.perf_counter() - t
            self.compiles += [(len(self.rows), name) for name in seen[n_seen:]]
            if sched is not None:
                prefill = sum(r.num_computed - before.get(id(r), 0) for r in sched.running
                              if r.num_computed <= r.prompt_len)
                self.rows.append((dt, prefill, len(sched.running), phase.get("_prepare_images", 0.0),
                                  phase.get("_run", 0.0)))
            return out

        eng.step = timed
        eng._prepare_images = timed_phase("_prepare_images")
        eng._run = timed_phase("_run")
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
        for name in self._orig:
            delattr(self.eng, name)  # back to the class's methods (a bound method kept on the instance is a cycle)
        self.eng, self._orig = None, None  # the engine must be freeable once the caller drops it

    def summary(self) -> dict:
        if not self.rows:
            return {}
        dts = np.array([r[0] for r in self.rows])
        med = float(np.median(dts))
        slow = [r for r in self.rows if r[0] > 3 * med]
        mem = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        delta = {k: mem.get(k, 0) - self._mem0.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                                     "num_device_free", "num_ooms")}
        top = sorted(self.rows, reverse=True)[:8]
        pre = [r for r in self.rows if r[1] > 0]  # steps that prefilled (chunks, with the decode rows beside them)
        dec = [r for r in self.rows if r[1] == 0]
        split = {"prefill_steps": len(pre), "prefill_steps_s": float(sum(r[0] for r in pre)),
                 "prefill_tokens": int(sum(r[1] for r in pre)), "decode_steps": len(dec),
                 "decode_steps_s": float(sum(r[0] for r in dec)),
                 "decode_step_median_ms": 1000 * float(np.median([r[0] for r in dec])) if dec else None}
        return {"steps": len(self.rows), "total_s": float(dts.sum()), "median_ms": 1000 * med, **split,
                "slow_steps": len(slow), "slow_total_s": float(sum(r[0] for r in slow)),
                "slow_vision_s": float(sum(r[3] for r in slow)), "slow_forward_s": float(sum(r[4] for r in slow)),
                "top_ms_prefill_running_vision_forward": [(round(1000 * a, 1), b, c, round(1000 * v, 1),
                                                           round(1000 * f, 1)) for a, b, c, v, f in top],
                "allocator": delta, "gc": {"collections": self._gc["collections"], "s": round(self._gc["s"], 4)},
                "profiled_prefill_forwards": self.profiles,
                "triton_compiles": [(i, round(1000 * self.rows[i][0], 1), name[:160]) for i, name in self.compiles
                                    if i < len(self.rows)]}


def load_engine(path: Path, **opts):
    from vlmctl.runtime.engine import Engine

    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    t0 = time.perf_counter()
    eng = Engine(path, **opts)
    sync()
    return eng, time.perf_counter() - t0, base


def weight_gib(eng) -> float:
    total = sum(t.numel() * t.element_size() for t in (eng.decoder.embed, eng.decoder.norm))
    if eng.decoder.lm_head is not eng.decoder.embed:
        total += eng.decoder.lm_head.numel() * eng.decoder.lm_head.element_size()
    for layer in eng.decoder.layers:
        total += layer.input_norm.numel() * 2 + layer.post_norm.numel() * 2
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += sum(t.numel() * t.element_size() for t in lin.tensors())
    return total / 2**30


def ttft_single(eng, cfg_kwargs: dict, n: int = 5) -> dict:
    from vlmctl.measure.bench import BenchConfig, synthetic_requests
    from vlmctl.runtime.sampling import SamplingParams

    cfg = BenchConfig(num_requests=n, concurrency=1, run=7, **cfg_kwargs)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    warm = [eng.encode(m, i) for m, i in synthetic_requests(cfg, 2, offset=500)]
    eng.generate(warm, params)
    ttfts, vision, prompt_tokens = [], [], 0
    for m, imgs in synthetic_requests(cfg, n):
        p = eng.encode(m, imgs)
        prompt_tokens = len(p.token_ids)
        t0 = time.perf_counter()
        req = eng.submit(p, params)
        while req.first_token_time is None:
            eng.step()
        ttfts.append(req.first_token_time - t0)
        while not req.finished:
            eng.step()
    # the vision part alone, on fresh images (no feature-cache hits)
    for m, imgs in synthetic_requests(cfg, n, offset=900):
        p = eng.encode(m, imgs)
        sync()
        t0 = time.perf_counter()
        eng.vision.encode(p.images)
        sync()
        vision.append(time.perf_counter() - t0)
    return {"ttft_ms_median": 1000 * float(np.median(ttfts)), "ttft_ms_all": [round(1000 * t, 2) for t in ttfts],
            "vision_ms_median": 1000 * float(np.median(vision)), "prompt_tokens": prompt_tokens}


def running_plus_burst(eng, cfg_kwargs: dict, running: int = 32, burst: int = 64) -> dict:
    """ITL and TPOT of `running` streams while a burst of new requests is admitted."""
    from vlmctl.measure.bench import BenchConfig, synthetic_requests
    from vlmctl.runtime.sampling import SamplingParams

    cfg = BenchConfig(num_requests=running + burst, concurrency=running + burst, run=11, **cfg_kwargs)
    reqs = synthetic_requests(cfg, running + burst)
    prompts = [eng.encode(m, i) for m, i in reqs]
    long = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    streams = [eng.submit(p, long) for p in prompts[:running]]
    times: dict[str, list[float]] = {r.id: [] for r in streams}
    burst_reqs, burst_at = [], None
    while not all(r.finished for r in streams):
        evs = eng.step()
        now = time.perf_counter()
        for ev in evs:
            if ev.request.id in times:
                times[ev.request.id].append(now)
        if burst_at is None and all(len(t) >= 24 for t in times.values()):
            burst_at = time.perf_counter()
            burst_reqs = [eng.submit(p, short) for p in prompts[running:]]
    while eng.has_work():
        eng.step()
    before, during = [], []
    burst_end = max(r.first_token_time for r in burst_reqs)
    for ts in times.values():
        for a, b in zip(ts, ts[1:]):
            (during if burst_at <= b <= burst_end else before).append(b - a)
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values()]
    burst_ttft = [r.first_token_time - burst_at for r in burst_reqs]
    pct = lambda a, q: 1000 * float(np.percentile(a, q)) if a else None  # noqa: E731
    return {"itl_ms_p50_before": pct(before, 50), "itl_ms_p50_during_burst": pct(during, 50),
            "itl_ms_p99_during_burst": pct(during, 99), "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "burst_admission_s": burst_end - burst_at, "burst_ttft_ms_p50": pct(burst_ttft, 50),
            "burst_ttft_ms_p99": pct(burst_ttft, 99)}


def hf_peer(ckpt: Path, cfg_kwargs: dict, batch: int, out_tokens: int) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from vlmctl.measure.bench import BenchConfig, synthetic_requests

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if dev == "cuda" else torch.float32
    proc = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).to(dev).eval()
    reqs = synthetic_requests(BenchConfig(num_requests=batch, run=3, **cfg_kwargs), batch)
    texts = [proc.apply_chat_template(m, add_generation_prompt=True) for m, _ in reqs]
    proc.tokenizer.padding_side = "left"
    inputs = proc(images=[i[0] for _, i in reqs], text=texts, return_tensors="pt", padding=True).to(dev)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    one = {k: v[:1] for k, v in inputs.items()}
    with torch.inference_mode():
        model.generate(**one, max_new_tokens=2, do_sample=False)
        sync()
        t0 = time.perf_counter()
        model.generate(**one, max_new_tokens=1, do_sample=False)
        sync()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(**inputs, max_new_tokens=out_tokens, min_new_tokens=out_tokens, do_sample=False)
        sync()
        wall = time.perf_counter() - t0
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"ttft_ms": 1000 * ttft, "batch": batch, "output_tok_s": batch * out_tokens / wall, "wall_s": wall}


def profile_bench(eng, cfg, profile_prefills: int = 0, profile_min_tokens: int = 1500) -> dict:
    """The bench again with other requests (other seeds: the same ones would come from the prefix
    cache), plain and then under cProfile; prints the engine thread's costliest calls."""
    import cProfile
    import dataclasses
    import io
    import pstats

    from vlmctl.measure.bench import bench_engine

    out = {}
    with StepLog(eng, profile_prefills, profile_min_tokens) as steps:
        r = bench_engine(eng, dataclasses.replace(cfg, run=cfg.run + 100))
    out["again_tok_s"] = r["output_throughput"]
    out["again_steps"] = steps.summary()
    log(f"bench again: {r['output_throughput']:.0f} output tok/s, {r['steps']} steps in {r['duration_s']:.2f} s")
    log("bench again steps:", json.dumps(out["again_steps"]))
    steps0 = eng.steps
    pr = cProfile.Profile()
    pr.enable()
    r = bench_engine(eng, dataclasses.replace(cfg, run=cfg.run + 200))
    pr.disable()
    out["profiled_tok_s"] = r["output_throughput"]
    log(f"bench under cProfile: {r['output_throughput']:.0f} output tok/s, {eng.steps - steps0} engine steps")
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(40)
        log("\n".join(line[:160] for line in buf.getvalue().splitlines()[-48:]))
    return out


def fp16_parts(engine_dir: Path, args, res: dict, dev: str, size: tuple, req: dict, n: int, min_tokens: int) -> None:
    """The fp16 engine's parts (load, TTFT, bench, burst, running + burst) into res; frees the engine."""
    from vlmctl.measure.bench import BenchConfig, bench_engine

    overlap = {"auto": None, "on": True, "off": False}[args.vision_overlap]
    eng, load_s, _ = load_engine(engine_dir, vision_overlap=overlap)
    res["engine"] = {"load_s": load_s, "load_phases_s": eng.load_seconds, "weights_gib": weight_gib(eng),
                     "vision": eng.vision_summary,
                     "limits": eng.limits.to_json()}
    if dev == "cuda":
        res["engine"]["gpu_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    log("engine:", json.dumps(res["engine"]))
    if "ttft" not in args.skip:
        res["ttft_single"] = ttft_single(eng, {"image_size": size, "prompt_len": 9})
        log("ttft single:", json.dumps(res["ttft_single"]))
    if "bench" not in args.skip:
        with StepLog(eng, args.kernel_profile, min_tokens) as steps:
            r = bench_engine(eng, BenchConfig(num_requests=n, concurrency=64, run=1, **req))
        res["bench_n256_c64"] = r
        res["bench_steps"] = steps.summary()
        log("bench steps:", json.dumps(res["bench_steps"]))
        log(f"bench -n {n} -c 64: {r['output_throughput']:.0f} output tok/s, TTFT p50 {r['ttft_ms']['median']:.0f} ms "
            f"p99 {r['ttft_ms']['p99']:.0f} ms, TPOT p50 {r['tpot_ms']['median']:.1f} p99 {r['tpot_ms']['p99']:.1f} ms, "
            f"prompt {r['mean_prompt_tokens']} tokens, failed {r['failed']}")
    if args.profile:
        res["bench_repeats"] = profile_bench(eng, BenchConfig(num_requests=n, concurrency=64, run=1, **req),
                                             args.kernel_profile, min_tokens)
    if "burst" not in args.skip:
        r = bench_engine(eng, BenchConfig(num_requests=64, concurrency=64, run=2, **req))
        res["burst_64"] = r
        log(f"burst of 64: TTFT p50 {r['ttft_ms']['median']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, "
            f"{r['output_throughput']:.0f} tok/s")
    if "running" not in args.skip:
        res["running_plus_burst"] = running_plus_burst(eng, {"image_size": size, "prompt_len": 9})
        log("running + burst:", json.dumps(res["running_plus_burst"]))
    res["engine_stats"] = eng.stats()
    eng_ref = weakref.ref(eng)
    del eng
    gc.collect()  # anything cyclic still holding the engine's memory
    if eng_ref() is not None:
        log("warning: the fp16 engine is still referenced; its GPU memory is not free for the next parts")
    if dev == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/vlmctl-bench"))
    ap.add_argument("--awq", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--skip", nargs="*", default=[],
                    help="parts to skip: ttft bench burst running hf awq, or fp16 (the fp16 engine is built but not "
                         "loaded: the AWQ engine then meets its first-use costs alone)")
    ap.add_argument("--profile", action="store_true",
                    help="after the bench, run it twice more with other requests: plain (does the first run of a "
                         "process pay one-off costs?) and under cProfile (where the engine thread's time goes)")
    ap.add_argument("--vision-overlap", choices=("auto", "on", "off"), default="auto",
                    help="the fp16 engine's vision_overlap (images of waiting requests encoded ahead; auto: the "
                         "engine's default, on with a GPU)")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="K",
                    help="profile (torch.profiler, CPU + CUDA) the first K forwards of >= 1,500 prompt tokens in "
                         "the bench and in its plain repeat: kernel time against wall time, top kernels and host ops")
    ap.add_argument("--out")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else SEVEN_B
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    t0 = time.perf_counter()
    ckpt = make_checkpoint(args.work / "ckpt", shape, dev)
    res["checkpoint_s"] = time.perf_counter() - t0
    engine_dir, res["build_s"] = build_engine(ckpt, args.work, "float16" if dev == "cuda" else "float32")
    log(f"checkpoint {res['checkpoint_s']:.1f} s, vlmctl build {res['build_s']:.1f} s")
    size = (shape["image"], shape["image"])
    req = dict(image_size=size, prompt_len=9, output_len=128, warmup=2)
    n = 16 if args.smoke else args.num_requests
    min_tokens = 8 if args.smoke else 1500  # a profiled forward's prompt tokens, at least
    if "fp16" not in args.skip:
        fp16_parts(engine_dir, args, res, dev, size, req, n, min_tokens)
    from vlmctl.measure.bench import BenchConfig, bench_engine

    if args.awq and "awq" not in args.skip:
        awq_dir = make_awq_engine(engine_dir, args.work, 64 if args.smoke else 128)
        aeng, aload, _ = load_engine(awq_dir)
        # timed as the fp16 engine's bench is (its steps logged, which syncs each phase), on the same requests
        with StepLog(aeng, args.kernel_profile, min_tokens) as steps:
            r = bench_engine(aeng, BenchConfig(num_requests=n, concurrency=64, run=1, **req))
        r1 = bench_engine(aeng, BenchConfig(num_requests=4, concurrency=1, run=6, **req))
        res["awq"] = {"load_s": aload, "load_phases_s": aeng.load_seconds, "weights_gib": weight_gib(aeng),
                      "bench_c64_tok_s": r["output_throughput"],
                      "bench_c64": r, "bench_c64_steps": steps.summary(), "bench_c1_tpot_ms": r1["tpot_ms"]["median"]}
        log("awq:", json.dumps(res["awq"]))
        del aeng
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    if "hf" not in args.skip:
        res["transformers"] = {"b1": hf_peer(ckpt, {"image_size": size, "prompt_len": 9}, 1, 32),
                               "b64": hf_peer(ckpt, {"image_size": size, "prompt_len": 9}, 64 if not args.smoke else 4,
                                              128 if not args.smoke else 8)}
        log("transformers:", json.dumps(res["transformers"]))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    if args.smoke:
        shutil.rmtree(args.work / "engine-awq", ignore_errors=True)


if __name__ == "__main__":
    main()
