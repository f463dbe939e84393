"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Gauges and the image-feature cache counters are read from the engine when /metrics is scraped;
latency histograms and token counters are fed by the async engine as requests progress.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "vlmctl"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _EngineCollector:
    """Values owned by the engine, sampled at scrape time (no locking needed: plain int reads)."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self):
        e, lab = self.engine, self.labels
        st = e.stats()
        gauges = [
            ("num_requests_running", "Requests in the running batch.", st["running"]),
            ("num_requests_waiting", "Requests waiting to be admitted.", st["waiting"]),
            ("num_requests_running_max", "Most requests ever held in the running batch at once.",
             st["max_running_seen"]),
            ("max_batch_size", "The largest possible running batch.", e.limits.max_batch_size),
        ]
        if "kv_blocks_total" in st:
            gauges += [("kv_cache_blocks_total", "Blocks of the paged KV cache.", st["kv_blocks_total"]),
                       ("kv_cache_blocks_used", "KV blocks held by requests.", st["kv_blocks_used"]),
                       ("kv_cache_blocks_free", "KV blocks free or holding evictable cached prefixes.",
                        st["kv_blocks_free"]),
                       ("kv_cache_usage_ratio", "Share of the KV cache held by requests.",
                        st["kv_blocks_used"] / max(1, st["kv_blocks_total"]))]
        if "cross_kv_blocks_total" in st:  # a decoder with cross-attention layers (Llama 3.2 Vision)
            gauges += [("cross_kv_cache_blocks_total", "Blocks of the cross-attention KV pool (image states).",
                        st["cross_kv_blocks_total"]),
                       ("cross_kv_cache_blocks_used", "Cross-attention KV blocks held by running requests.",
                        st["cross_kv_blocks_used"])]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(lab))
            g.add_metric(list(lab.values()), value)
            yield g
        info = GaugeMetricFamily(f"{PREFIX}_vision_backend_info", "The vision backend in use (value 1).",
                                 labels=list(lab) + ["backend"])
        info.add_metric(list(lab.values()) + [st["vision_backend"]], 1)
        yield info
        if "kv_cache_dtype" in st:
            kv = GaugeMetricFamily(f"{PREFIX}_kv_cache_config_info", "The paged KV pool's storage and block size "
                                   "(value 1).", labels=list(lab) + ["dtype", "block_size"])
            kv.add_metric(list(lab.values()) + [st["kv_cache_dtype"], str(st["kv_block_size"])], 1)
            yield kv
        counters = [
            ("engine_steps", "Engine steps run (decoder forwards).", st["steps"]),
            ("engine_steps_ahead", "Engine steps launched before the previous step's tokens were read (async "
             "scheduling).", st["steps_ahead"]),
            ("image_feature_cache_hits", "Images whose features came from the content-hash cache.",
             st["feature_cache_hits"]),
            ("image_feature_cache_misses", "Images that went through the vision model.", st["feature_cache_misses"]),
        ]
        if "preemptions" in st:
            counters += [("num_preemptions", "Requests preempted (KV cache full) and recomputed later.",
                          st["preemptions"]),
                         ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          st["prefix_cache_queried_tokens"]),
                         ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled again).",
                          st["prefix_cache_hit_tokens"])]
        for name, doc, value in counters:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(lab))
            c.add_metric(list(lab.values()), value)
            yield c


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        lab = ["model_name"]
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token.",
                              lab, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first.", lab,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.batch = Histogram(f"{PREFIX}_batch_size", "Requests advanced together in one engine step.", lab,
                               buckets=BATCH_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of submitted requests (image "
                                     "tokens included).", lab, registry=r).labels(model_name)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        self._finished = Counter(f"{PREFIX}_request_success", "Finished requests by finish reason.",
                                 lab + ["finished_reason"], registry=r)
        self.aborted = Counter(f"{PREFIX}_request_aborted", "Requests aborted (client gone or shutdown).", lab,
                               registry=r).labels(model_name)
        self.model_name = model_name

    def on_finished(self, req) -> None:
        self._finished.labels(self.model_name, req.finish_reason or "abort").inc()
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival)
        if req.finish_time is not None:
            self.e2e.observe(req.finish_time - req.arrival)
            n = len(req.output_ids)
            if n > 1 and req.first_token_time is not None:
                self.tpot.observe((req.finish_time - req.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
