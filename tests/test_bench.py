"""`vlmctl bench`: offline engine bench on the tiny LLaVA; the --url mode against a served model (also in
test_serve.py)."""

from __future__ import annotations

import json

import pytest

from conftest import cli, cli_json


def test_offline_bench_json_and_batching(tiny_llava_engine, tmp_path, capsys):
    out = tmp_path / "sub" / "bench.json"
    res = cli_json("bench", tiny_llava_engine, "-n", "6", "-c", "1", "-c", "3", "--output-len", "5",
                   "--image-size", "32x24", "--prompt-len", "6", "--max-batch-size", "4", "--out", out, "--json",
                   capsys=capsys)
    assert json.loads(out.read_text()) == res
    one, three = res["runs"]
    for run, c in ((one, 1), (three, 3)):
        assert run["mode"] == "engine" and run["config"]["concurrency"] == c
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 6 * 5
        assert run["mean_prompt_tokens"] > 6
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = run[key]
            assert stats["mean"] > 0 and stats["median"] > 0 and stats["p99"] >= stats["median"] * 0.999
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    assert one["max_running"] == 1 and one["mean_batch_size"] == 1
    assert three["max_running"] == 3 and three["mean_batch_size"] > 1
    assert res["output_throughput_vs_first"][0] == 1.0


def test_offline_bench_counts_preemptions(tiny_llava_engine):
    """An engine run reports its preemptions: none where the KV pool holds every request in flight, some where it
    holds two prompts but not their answers (admitted together, they outgrow it; all still complete)."""
    from vlmctl.measure.bench import BenchConfig, bench_engine
    from vlmctl.runtime.engine import Engine

    out = 24
    cfg = BenchConfig(num_requests=4, concurrency=4, output_len=out, image_size=(16, 16), prompt_len=4, warmup=0)
    roomy = bench_engine(Engine(tiny_llava_engine, block_size=4), cfg)
    assert roomy["preemptions"] == 0 and roomy["kv_cache_tokens"] >= 4 * (roomy["mean_prompt_tokens"] + out)
    tight = bench_engine(Engine(tiny_llava_engine, block_size=4,
                                kv_cache_tokens=2 * int(roomy["mean_prompt_tokens"]) + 12), cfg)
    assert tight["completed"] == 4 and tight["preemptions"] > 0, tight


def test_offline_bench_table_output(tiny_llava_engine, capsys):
    _, o, _ = cli("bench", tiny_llava_engine, "-n", "2", "-c", "2", "--output-len", "3", "--image-size", "16x16",
                  "--prompt-len", "2", "--warmup", "0", "--same-image", capsys=capsys)
    assert "output tokens/s" in o and "TTFT ms p99" in o and "max running batch" in o and "preemptions" in o


def test_same_image_hits_the_feature_cache(tiny_llava_engine):
    from vlmctl.measure.bench import BenchConfig, bench_engine
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine, enable_prefix_caching=False)  # else the image's KV blocks are reused instead
    bench_engine(eng, BenchConfig(num_requests=4, concurrency=1, output_len=2, image_size=(16, 16), prompt_len=2,
                                  same_image=True, warmup=0))
    assert eng.feature_cache.misses == 1 and eng.feature_cache.hits == 3


@pytest.mark.parametrize("args,fragment", [
    ((), "ENGINE_DIR"),
    (("--url", "http://127.0.0.1:9", "ENGINE"), "not both"),
    (("ENGINE", "--image-size", "big"), "WIDTHxHEIGHT"),
    (("ENGINE", "-c", "0"), "concurrency"),
    # the images are made before the engine sees them: 100000x100000 would be 28 GiB of RGB
    (("ENGINE", "--image-size", "100000x100000", "-n", "1"), "longest side accepted is 16384"),
])
def test_bench_bad_arguments(tiny_llava_engine, capsys, args, fragment):
    """Command-line mistakes exit 2 (README's table) with one line, before anything is built."""
    args = [str(tiny_llava_engine) if a == "ENGINE" else a for a in args]
    code, _, err = cli("bench", *args, capsys=capsys, expect=None)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, (code, err)


def test_url_bench_unreachable_server_is_a_clear_error(capsys):
    code, _, err = cli("bench", "--url", "http://127.0.0.1:9", "-n", "1", "--timeout", "2", capsys=capsys,
                       expect=None)
    assert code != 0 and "cannot list the server's models" in err


def test_summarize_statistics():
    from vlmctl.measure.bench import Sample, summarize

    samples = [Sample(start=0.0, token_times=[0.1, 0.2, 0.4], output_tokens=3, prompt_tokens=10),
               Sample(start=1.0, token_times=[1.3, 1.4, 1.5], output_tokens=3, prompt_tokens=20),
               Sample(start=2.0, error="boom")]
    s = summarize(samples, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["total_output_tokens"] == 6 and s["output_throughput"] == 3.0 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(450.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(125.0)  # (0.3/2 + 0.2/2) / 2
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["mean_prompt_tokens"] == 15


def test_url_bench_counts_a_stream_without_text_as_completed(tmp_path, capsys):
    """A model whose every token decodes to "" (here: a zeroed lm_head, so greedy decoding picks token 0,
    the special <unk>, which detokenization skips) streams no text at all; such a request completed."""
    from safetensors.torch import load_file, save_file
    from test_serve import start_uvicorn
    from tiny_models import make_llava

    from conftest import write_recipe
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.serve import ServerConfig, load_app

    ckpt = make_llava(tmp_path / "ckpt", seed=4)
    for f in ckpt.glob("*.safetensors"):
        state = load_file(str(f))
        heads = [k for k in state if k.endswith("lm_head.weight")]
        assert heads
        for k in heads:
            state[k] = state[k] * 0
        save_file(state, str(f), metadata={"format": "pt"})
    build(load_recipe(write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 4})), tmp_path / "eng")
    app = load_app(tmp_path / "eng", ServerConfig(stats_interval_s=0))
    url, stop = start_uvicorn(app)
    try:
        res = cli_json("bench", "--url", url, "-n", "4", "-c", "2", "--output-len", "5", "--image-size", "32x32",
                       "--prompt-len", "3", "--json", capsys=capsys)
    finally:
        stop()
    run = res["runs"][0]
    assert run["completed"] == 4 and run["failed"] == 0, run["errors"]
    assert run["total_output_tokens"] == 4 * 5
    assert run["ttft_ms"]["mean"] > 0 and run["e2e_ms"]["mean"] >= run["ttft_ms"]["mean"]
