"""OpenAI-compatible HTTP serving of an engine directory (FastAPI + uvicorn).

app.py wires the application together; endpoints.py holds the two completion endpoints, which
use openai_fields.py (every OpenAI request field and vlmctl's decision), openai_request.py (body ->
engine work), render.py (events -> OpenAI objects; token_bytes.py a token's exact bytes for logprobs)
and streaming.py (whole or SSE); schema.py holds
the request/response models, errors.py the OpenAI-shaped errors, middleware.py the API-key guard
and the access log, logs.py the log format and the periodic stats line, media.py the image
loading under the server's media policy, async_engine.py the engine's step thread, metrics.py the
Prometheus metrics. Nothing here is imported by `vlmctl --help`.
"""

from .app import ServerConfig, create_app, load_app
from .media import MediaPolicy

__all__ = ["MediaPolicy", "ServerConfig", "check_listen_address", "create_app", "load_app", "run_server"]


def check_listen_address(host: str, port: int) -> None:
    """OptionError unless this machine can listen on host:port now (a name that does not resolve, an
    address that is not this machine's, a port in use): checked before the engine loads, for minutes."""
    import socket

    from ..errors import OptionError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise OptionError(f"--host {host!r}: not an address to listen on ({getattr(e, 'strerror', None) or e})") \
            from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise OptionError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def run_server(app, host: str = "127.0.0.1", port: int = 23333, *, shutdown_timeout_s: float = 30.0,
               log_level: str = "info", log_format: str = "text", sockets=None) -> None:
    """Run `app` with uvicorn until SIGINT/SIGTERM. On SIGTERM uvicorn stops accepting connections,
    lets open requests finish for up to `shutdown_timeout_s` seconds (then cancels them, which aborts
    them in the engine), runs the app's shutdown, and this function returns normally. vlmctl's and
    uvicorn's logs go to stderr in `log_format` (logs.py); uvicorn's own access log is replaced by
    vlmctl's (one line per request with its tokens and timings), except at debug and trace, where both are written."""
    import signal
    import threading

    import uvicorn

    from .logs import configure_logging

    configure_logging(log_level, log_format)
    # uvicorn drops its access logger's handlers unless access_log is on: at debug and trace its own lines
    # come beside vlmctl's (docs/serving.md)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=log_level in ("debug", "trace"), log_config=None,
                            timeout_graceful_shutdown=shutdown_timeout_s, lifespan="on")
    server = uvicorn.Server(config)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught once it has shut down, under the handler that was
        # installed before it started; a no-op handler here makes a graceful SIGTERM exit with 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=sockets)
    except SystemExit:  # uvicorn exits when it cannot bind
        if server.started:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        from ..errors import VlmctlError

        raise VlmctlError(f"the server did not start on {host}:{port} (port in use?)")
