from __future__ import annotations

import os
from pathlib import Path

import typer

from .common import KvCacheDtypeOption

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve_command(
    engine_dir: Path = typer.Argument(..., help="Engine directory made by `vlmctl build`"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on"),
    port: int = typer.Option(23333, "--port", min=1, max=65535, help="Port to listen on"),
    api_key: list[str] = typer.Option(None, "--api-key", help="Require `Authorization: Bearer KEY` on /v1/* "
                                      "(repeatable; also VLMCTL_API_KEY)"),
    model_name: str = typer.Option(None, "--model-name", help="Model id clients send (default: the engine's name)"),
    max_batch_size: int = typer.Option(None, "--max-batch-size", min=1, help="The most requests running at once "
                                       "(default, and most: the engine's built limit)"),
    max_input_len: int = typer.Option(None, "--max-input-len", min=1, help="Lower the prompt-length limit (tokens)"),
    max_output_len: int = typer.Option(None, "--max-output-len", min=1, help="Lower the max_tokens limit"),
    max_images: int = typer.Option(None, "--max-images-per-request", min=0,
                                   help="Images one request may carry (default: the engine's built limit). With the "
                                        "torch decoder it may go above the built limit, up to max_input_len (the "
                                        "prompt table is per request; prompts stay within max_input_len); the "
                                        "TensorRT-LLM decoder and a TensorRT vision engine keep the built limit"),
    max_stop_sequences: int = typer.Option(4, "--max-stop-sequences", min=0,
                                           help="Most `stop` strings one request may give (OpenAI's limit is 4)"),
    max_image_side: int = typer.Option(None, "--max-image-side", min=1,
                                       help="Longest image side accepted, in pixels (default 16384)"),
    max_image_aspect_ratio: float = typer.Option(None, "--max-image-aspect-ratio", min=1.0,
                                                 help="Largest long-side/short-side ratio accepted (default 200)"),
    max_image_pixels: int = typer.Option(None, "--max-image-pixels", min=1,
                                         help="Most pixels (width x height) one image may have, checked on its "
                                              "header before decoding (default 67108864, 8192x8192)"),
    feature_cache_size: int = typer.Option(256, "--feature-cache-size", min=0, help="Images whose features are "
                                           "cached"),
    allowed_local_media_path: Path = typer.Option(None, "--allowed-local-media-path",
                                                  help="Allow file:// image URLs under this directory only"),
    allowed_media_domains: list[str] = typer.Option(None, "--allowed-media-domains",
                                                    help="Allow http(s) image URLs from these hosts (repeatable "
                                                         "or comma-separated; default: none)"),
    allow_private_media_addresses: bool = typer.Option(False, "--allow-private-media-addresses",
                                                       help="Let allowed media hosts resolve to loopback, "
                                                            "link-local or private addresses (refused by default)"),
    media_timeout: float = typer.Option(10.0, "--media-timeout", help="Seconds allowed for one whole image fetch"),
    max_media_bytes: int = typer.Option(20 * 1024 * 1024, "--max-media-bytes", help="Byte cap of one image"),
    max_body_bytes: int = typer.Option(32 * 1024 * 1024, "--max-body-bytes", help="Byte cap of a request body "
                                       "(413 beyond)"),
    max_videos: int = typer.Option(None, "--max-videos-per-request", min=0, help="Videos one request may carry "
                                   "(default 1; video families only)"),
    max_video_frames: int = typer.Option(None, "--max-video-frames", min=1, help="Frames sampled from one video, "
                                         "at most (default 64; the model's fps rule is capped to it)"),
    max_video_bytes: int = typer.Option(64 * 1024 * 1024, "--max-video-bytes", min=1, help="Byte cap of one video"),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", min=0.0, help="On SIGTERM, seconds open "
                                           "requests may take to finish"),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the usable CPUs "
                                                             "minus one)"),
    max_num_batched_tokens: int = typer.Option(None, "--max-num-batched-tokens", min=1,
                                               help="Tokens one engine step computes: prompt chunks + decode "
                                                    "(default: 2048 on a GPU, 512 on a CPU)"),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", min=0.01, max=1.0,
                                                 help="Share of the GPU's memory the engine may use; the KV cache "
                                                      "gets what weights, vision and activations leave"),
    kv_cache_tokens: int = typer.Option(None, "--kv-cache-tokens", min=1, help="KV cache size in tokens (overrides "
                                        "--gpu-memory-utilization; CPU default: max batch x max sequence)"),
    kv_cache_dtype: str = KvCacheDtypeOption,
    prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                        help="Reuse the KV of repeated prefixes (tokens and images)"),
    vision_backend: str = typer.Option("auto", "--vision-backend", help="auto, tensorrt, onnxruntime-gpu, "
                                       "onnxruntime or torch"),
    vision_batch_size: int = typer.Option(32, "--vision-batch-size", min=1, help="Images per vision call"),
    vision_overlap: bool | None = typer.Option(None, "--vision-overlap/--no-vision-overlap",
                                               help="Encode waiting requests' images on a worker thread while "
                                               "steps run [default: on with a GPU]", show_default=False),
    async_scheduling: bool | None = typer.Option(None, "--async-scheduling/--no-async-scheduling",
                                                 help="Launch each decode step before the previous step's tokens "
                                                 "are read, so detokenizing and scheduling overlap the GPU "
                                                 "[default: on with a GPU]", show_default=False),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="Replay decode steps, steps with prompt "
                                     "rows up to VLMCTL_STEP_GRAPH_ROWS (384) and the vision calls of families that "
                                     "allow it as CUDA graphs"),
    log_level: str = typer.Option("info", "--log-level", help=f"Log level of the server ({', '.join(LOG_LEVELS)}); "
                                  "info shows one access line per request and the periodic stats line"),
    log_format: str = typer.Option("text", "--log-format", help="text, or json: one JSON object per line (time, "
                                   "level, logger, message and the record's fields) for log shippers"),
    log_requests_text: bool = typer.Option(False, "--log-requests-text", help="Put prompt and output texts in the "
                                           "access log (off by default: they may be private)"),
    stats_interval: float = typer.Option(10.0, "--stats-interval", min=0.0, help="Seconds between stats lines "
                                         "(throughput, queue, KV cache, cache hit rates) while busy; 0: none"),
):
    from ..errors import OptionError
    from ..host import configure_threads, resolve_device

    keys = list(api_key or [])
    if any(not k.strip() for k in keys):
        # `--api-key "$KEY"` with KEY unset: starting open while the operator meant a key is the worst outcome.
        raise OptionError("--api-key is empty (an unset variable?); give a non-empty key or leave the option out")
    if not keys and os.environ.get("VLMCTL_API_KEY", "").strip():
        keys = [os.environ["VLMCTL_API_KEY"].strip()]
    if log_level.lower() not in LOG_LEVELS:
        raise OptionError(f"--log-level {log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
    if log_format not in ("text", "json"):
        raise OptionError(f"--log-format {log_format!r}: expected text or json")
    local = None
    if allowed_local_media_path is not None:
        local = allowed_local_media_path.resolve()
        if not local.is_dir():
            raise OptionError(f"--allowed-local-media-path {allowed_local_media_path}: not a directory")
    domains = [d.strip() for v in allowed_media_domains or [] for d in v.split(",") if d.strip()]
    for name, value in (("--max-body-bytes", max_body_bytes), ("--max-media-bytes", max_media_bytes),
                        ("--media-timeout", media_timeout)):
        if not value > 0:
            raise OptionError(f"{name} must be positive (got {value})")
    device = resolve_device(device)
    configure_threads(threads)

    from ..serve import check_listen_address
    from ..serve.logs import configure_logging

    check_listen_address(host, port)

    configure_logging(log_level, log_format)  # before the engine loads: its warnings go the same way

    from ..media.video import VideoLimits
    from ..runtime.engine import EngineOptions
    from ..runtime.image_limits import ImageLimits
    from ..serve import MediaPolicy, ServerConfig, load_app, run_server

    config = ServerConfig(model_name=model_name, api_keys=keys, max_body_bytes=max_body_bytes,
                          log_requests_text=log_requests_text, stats_interval_s=stats_interval,
                          media=MediaPolicy(allowed_domains=domains, allowed_local_path=local,
                                            timeout_s=media_timeout, max_bytes=max_media_bytes,
                                            max_video_bytes=max_video_bytes,
                                            allow_private_addresses=allow_private_media_addresses))
    options = EngineOptions(device=device, max_batch_size=max_batch_size, max_input_len=max_input_len,
                            max_output_len=max_output_len, max_images_per_request=max_images,
                            max_num_batched_tokens=max_num_batched_tokens,
                            gpu_memory_utilization=gpu_memory_utilization, kv_cache_tokens=kv_cache_tokens,
                            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=prefix_caching, vision_backend=vision_backend,
                            vision_batch_size=vision_batch_size, vision_overlap=vision_overlap, cuda_graphs=cuda_graphs,
                            async_scheduling=async_scheduling,
                            feature_cache_size=feature_cache_size, max_stop_sequences=max_stop_sequences,
                            image_limits=ImageLimits.with_overrides(max_side=max_image_side,
                                                                    max_aspect_ratio=max_image_aspect_ratio,
                                                                    max_pixels=max_image_pixels),
                            video_limits=VideoLimits.with_overrides(max_videos_per_request=max_videos,
                                                                    max_frames=max_video_frames))
    app = load_app(engine_dir, config, options)
    eng = app.state.engine
    import logging

    # a log line, not console output: with --log-format json every line on stderr is one JSON object
    logging.getLogger("vlmctl.serve").info(
        "vlmctl serve %s on http://%s:%d/v1 (%s; max batch %d; %s%svision %s; %s)", app.state.model_name, host, port,
        eng.device, eng.limits.max_batch_size,
        f"KV cache {eng.limits.kv_cache_tokens} tokens"
        f"{'' if eng.kv_cache_dtype == 'auto' else ' (' + eng.kv_cache_dtype + ')'}; "
        if eng.limits.kv_cache_tokens else "",
        "async scheduling; " if eng.async_scheduling else "", eng.vision_summary,
        "API key required" if keys else "no API key")
    run_server(app, host, port, shutdown_timeout_s=shutdown_timeout, log_level=log_level.lower(),
               log_format=log_format)
