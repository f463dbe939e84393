"""`vlmctl bench` and `vlmctl eval ppl` as a user meets them: bad values, failed requests, a server that dies
or misbehaves mid-run, per-run figures against a long-lived server, perplexity against a hand computation."""

from __future__ import annotations

import http.server
import json
import math
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import cli, serve_process


def one_error_line(err: str) -> str:
    """The one `error:` line of a failed command (and no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("error:"), err[-2000:]
    assert sum(line.startswith("error:") for line in lines) == 1, err[-2000:]
    return lines[-1]


# ---- bench: bad values ---------------------------------------------------------------------------
@pytest.mark.parametrize("args,fragment", [
    (("ENGINE", "--seed", "-1"), "seed"),  # was a numpy traceback
    (("--url", "http://127.0.0.1:9", "--seed", "-1"), "seed"),
    (("ENGINE", "--temperature", "-1"), "temperature"),  # was exit 5 (and against a server, each request a 400)
    (("--url", "http://127.0.0.1:99999"), "Port out of range"),  # was an OverflowError traceback
    (("--url", "localhost:23333"), "http://"),  # was exit 5, "cannot list the server's models"
    (("--url", "http://127.0.0.1:9", "--timeout", "0"), "--timeout"),  # was exit 5, a ConnectTimeout
    (("ENGINE", "--out", "TMP"), "is a directory"),  # was exit 1 once the whole bench had run
    (("ENGINE", "--out", "FILE/sub/r.json"), "not a writable directory"),  # a parent that is a file
])
def test_bench_bad_values_exit_2_with_one_line(tiny_llava_engine, tmp_path, capsys, args, fragment):
    (tmp_path / "FILE").write_text("x")
    args = [str(tiny_llava_engine) if a == "ENGINE" else str(tmp_path) if a == "TMP" else
            str(tmp_path / a) if a.startswith("FILE") else a for a in args]
    code, out, err = cli("bench", *args, "-n", "1", "--output-len", "1", "--json", capsys=capsys, expect=None)
    assert code == 2 and out == "", (code, out, err)
    assert fragment in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing made


def test_bench_out_under_new_directories_is_made_only_after_a_good_run(tiny_llava_engine, tmp_path, capsys):
    """--out a/b/r.json: a run refused on its other values creates neither a nor b; a good run writes the file."""
    target = tmp_path / "a" / "b" / "r.json"
    code, _, _ = cli("bench", str(tiny_llava_engine), "--seed", "-1", "--out", str(target), capsys=capsys, expect=None)
    assert code == 2 and not (tmp_path / "a").exists()
    code, out, err = cli("bench", str(tiny_llava_engine), "-n", "1", "-c", "1", "--output-len", "1", "--warmup", "0",
                         "--image-size", "16x16", "--out", str(target), "--json", capsys=capsys, expect=None)
    assert code == 0, err
    assert json.loads(target.read_text()) == json.loads(out)


# ---- bench: failed requests ----------------------------------------------------------------------
def test_url_bench_where_every_request_fails_exits_1_and_still_reports(srv, tmp_path, capsys):
    """A run whose requests all got an HTTP error (an unknown model) reported exit 0, like a clean run."""
    url, _ = srv
    out_file = tmp_path / "r.json"
    code, out, err = cli("bench", "--url", url, "--model", "nope", "--warmup", "0", "-n", "3", "-c", "2",
                         "--output-len", "2", "--image-size", "16x16", "--out", out_file, "--json", capsys=capsys,
                         expect=None)
    assert code == 1, (code, err)
    res = json.loads(out)  # stdout holds the JSON object and nothing else
    assert json.loads(out_file.read_text()) == res
    run = res["runs"][0]
    assert run["completed"] == 0 and run["failed"] == 3 and "HTTP 404" in run["errors"][0]
    line = one_error_line(err)
    assert "3 of 3 requests failed" in line and "HTTP 404" in line


def test_url_bench_against_a_server_killed_mid_run(tiny_llava_engine, tmp_path):
    """A real `vlmctl serve` process killed after some requests completed: the bench reports the ones that did,
    counts the rest as failed and exits 1 with one error line (it exited 0 before)."""
    with serve_process(tiny_llava_engine, tmp_path) as (server, url):
        bench = subprocess.Popen([sys.executable, "-m", "vlmctl", "bench", "--url", url, "-n", "40", "-c", "2",
                                  "--output-len", "200", "--image-size", "16x16", "--prompt-len", "2", "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 120
            done = 0.0
            while done < 4:  # the warm-up request and 3 timed ones
                assert bench.poll() is None, bench.communicate()
                assert time.monotonic() < deadline, "the bench completed no requests"
                text = httpx.get(url + "/metrics", timeout=10).text
                done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("vlmctl_request_success_total{"))
                time.sleep(0.05)
            server.kill()
            server.wait(10)
            out, err = bench.communicate(timeout=120)
        finally:
            if bench.poll() is None:
                bench.kill()
    assert bench.returncode == 1, err[-2000:]
    run = json.loads(out)["runs"][0]
    assert run["completed"] >= 3 and run["failed"] >= 1 and run["completed"] + run["failed"] == 40
    assert run["total_output_tokens"] == 200 * run["completed"]
    assert f"{run['failed']} of 40 requests failed" in one_error_line(err)


# ---- bench: the largest batch of each run, against a long-lived server ---------------------------------------
def test_url_bench_max_running_is_the_runs_own(srv, capsys):
    """The server's `vlmctl_num_requests_running_max` is its all-time maximum: a concurrency-1 run after a
    concurrency-4 run reported the earlier run's batch, above its own concurrency."""
    url, _ = srv
    code, out, err = cli("bench", "--url", url, "-n", "8", "-c", "4", "-c", "1", "--output-len", "4",
                         "--image-size", "16x16", "--prompt-len", "2", "--json", capsys=capsys, expect=None)
    assert code == 0, err
    four, one = json.loads(out)["runs"]
    metrics = httpx.get(url + "/metrics", timeout=10).text
    all_time = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("vlmctl_num_requests_running_max{"))
    assert all_time >= 2  # else this test could not tell the run's figure from the server's
    assert one["max_running"] == 1 and one["mean_batch_size"] == 1
    assert 1 <= four["max_running"] <= 4


# ---- bench: a server that is not quite OpenAI's ---------------------------------------------------
class _OddServer(http.server.BaseHTTPRequestHandler):
    """Stands in for a third-party "OpenAI-compatible" server (a vlmctl server never answers like this):
    `models` is the /v1/models body; chat completions stream `events` (SSE `data:` lines)."""

    models = b'{"data": [{"id": "m"}]}'
    events: tuple[bytes, ...] = ()

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(self.models if self.path == "/v1/models" else b"", "application/json")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(b"".join(b"data: " + e + b"\n\n" for e in self.events), "text/event-stream")

    def log_message(self, *args):
        pass


@pytest.fixture
def odd_server():
    handler = type("Handler", (_OddServer,), {})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


def test_url_bench_models_list_that_is_not_an_object(odd_server, capsys):
    url, handler = odd_server
    handler.models = b"[1, 2]"  # was a TypeError traceback
    code, _, err = cli("bench", "--url", url, "-n", "1", "--image-size", "8x8", capsys=capsys, expect=None)
    assert code == 5 and "cannot list the server's models" in one_error_line(err)


@pytest.mark.parametrize("event,fragment", [
    (b"{not json", "malformed stream event"),  # was a JSONDecodeError traceback
    (b'{"error": "overloaded"}', "overloaded"),  # a bare-string error: was an AttributeError traceback
    (b'{"choices": [{"delta": {"content": "a"}}], "usage": {"prompt_tokens": 3}}', "malformed stream event"),
])
def test_url_bench_malformed_events_are_failed_requests(odd_server, capsys, event, fragment):
    url, handler = odd_server
    handler.events = (b'{"choices": [{"delta": {"content": "a"}}]}', event, b"[DONE]")
    code, out, err = cli("bench", "--url", url, "-n", "2", "-c", "1", "--warmup", "0", "--image-size", "8x8",
                         "--output-len", "2", "--json", capsys=capsys, expect=None)
    assert code == 1, err
    run = json.loads(out)["runs"][0]
    assert run["failed"] == 2 and fragment in run["errors"][0]
    assert fragment in one_error_line(err)


# ---- eval ppl ----------------------------------------------------------------------------------------
TEXT = ("The quick brown fox jumps over the lazy dog near the river bank. " * 40
        + "A picture shows a small red house under a large green tree. " * 40)


def _hand_perplexity(llm_dir, text: str, seq_len: int, windows: int) -> float:
    """exp(mean NLL) of every token after the first of each window, by transformers' own model, in float64."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llm_dir))
    model = AutoModelForCausalLM.from_pretrained(str(llm_dir), dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    nll, n = 0.0, 0
    for w in range(windows):
        window = ids[w * seq_len:(w + 1) * seq_len]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([window])).logits[0].double(), -1)
        for t in range(1, seq_len):
            nll -= float(logp[t - 1, window[t]])
            n += 1
    return math.exp(nll / n)


def test_eval_ppl_equals_a_hand_computation(tiny_llava_engine, tmp_path, capsys):
    data = tmp_path / "eval.txt"
    data.write_text(TEXT)
    llm = tiny_llava_engine / "convert" / "llm"
    want = _hand_perplexity(llm, TEXT, seq_len=24, windows=3)
    for model in (llm, tiny_llava_engine):  # the HF decoder and the engine's torch layout
        code, out, err = cli("eval", "ppl", model, "--data", data, "--seq-len", "24", "--samples", "3", "--json",
                             capsys=capsys, expect=None)
        assert code == 0, err
        res = json.loads(out)
        assert res["perplexity"] == pytest.approx(want, rel=1e-4)
        assert res["samples"] == 3 and res["tokens"] == 3 * 23


def _broken_copy(tiny_llava_engine, tmp_path, how: str):
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path / how
    shutil.copytree(tiny_llava_engine / "convert" / "llm", d)
    f = next(d.glob("*.safetensors"))
    state = load_file(str(f))
    if how == "huge":
        state["lm_head.weight"] = state["lm_head.weight"] * 1e5  # logits ~1e5 apart: mean NLL far beyond 709
    else:
        state["lm_head.weight"][0, 0] = torch.nan  # every logit of token 0 is NaN
    save_file(state, str(f), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("how,fragment", [("huge", "beyond any float"), ("nan", "not finite")])
def test_eval_ppl_of_a_broken_model_is_one_error_line(tiny_llava_engine, tmp_path, capsys, how, fragment):
    """exp() of a mean NLL above 709 raised OverflowError (a traceback); a NaN printed `"perplexity": NaN`,
    which is not JSON, with exit 0."""
    data = tmp_path / "eval.txt"
    data.write_text(TEXT)
    model = _broken_copy(tiny_llava_engine, tmp_path, how)
    code, out, err = cli("eval", "ppl", model, "--data", data, "--seq-len", "16", "--samples", "2", "--json",
                         capsys=capsys, expect=None)
    assert code == 3 and out == "", (code, out, err)
    assert fragment in one_error_line(err)
