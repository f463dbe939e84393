"""Loading the images of `image_url` and the videos of `video_url` content parts: data: URLs, http(s)
URLs, local files.

Policy, not convenience: remote fetches go only to hosts named in `allowed_domains` (none by
default), within one deadline for the whole fetch (every redirect hop, every body byte), under a byte
cap counted while the body streams, and with no redirects to other hosts. An allowed name must also
resolve to public addresses only (no loopback, link-local, private or reserved ranges, unless
`allow_private_addresses`), and the connection goes to the address that was checked, so a DNS
answer that changes between check and connect cannot redirect it. `file://` URLs are read only
when they resolve (symlinks followed) inside `allowed_local_path`, and only as regular files opened
without blocking (a FIFO or device is refused, never waited on), off the event loop within the
timeout; a refusal names the path the client sent, never what it resolves to. An image's size (the engine's `ImageLimits`: side, pixel
count, aspect ratio) is checked on its header, before any pixel is decoded. Every failure is an `InputError`
(HTTP 400) whose message says which image and why. Videos follow the same policy with their own
byte cap (`max_video_bytes`); decoding them is media/video.py's. No audio.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from ..errors import InputError, LimitError
from ..runtime.image_limits import ImageLimits
from ..runtime.image_limits import decode_image as decode_checked

MAX_REDIRECTS = 3


@dataclass
class MediaPolicy:
    allowed_domains: list[str] = field(default_factory=list)  # exact host names (case-insensitive)
    allowed_local_path: Path | None = None
    timeout_s: float = 10.0  # the whole fetch, redirects and body included
    max_bytes: int = 20 * 1024 * 1024
    max_video_bytes: int = 64 * 1024 * 1024  # a video's file (videos are larger than images)
    allow_private_addresses: bool = False  # let allowed hosts resolve to loopback/private/link-local addresses

    def host_allowed(self, host: str | None) -> bool:
        host = (host or "").lower().rstrip(".")
        return any(host == d.lower().rstrip(".") for d in self.allowed_domains)


def decode_image(data: bytes, what: str, limits: ImageLimits | None = None):
    """Bytes -> RGB PIL image (`runtime.image_limits.decode_image`: sizes checked on the header)."""
    return decode_checked(io.BytesIO(data), what, limits, "the data is not a decodable image")


def parse_data_url(url: str, what: str, kind: str = "image") -> bytes:
    """`data:[<mime>][;base64],<payload>` -> the payload bytes (`kind`: the media type a mime must name)."""
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise InputError(f"{what}: malformed data URL (no ',' before the payload)")
    params = head.split(";")
    mime = params[0].strip().lower()
    if mime and not mime.startswith(f"{kind}/"):
        raise InputError(f"{what}: data URL media type {mime!r} is not {'an' if kind == 'image' else 'a'} {kind}")
    if "base64" not in [p.strip().lower() for p in params[1:]]:
        return unquote(payload).encode("latin-1", errors="replace")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"{what}: invalid base64 in data URL ({e})") from None


def read_local(url: str, policy: MediaPolicy, what: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a `file://` URL under the allowed local path: only a regular file, opened without
    blocking and judged on the open descriptor (`media.local_files.read_regular_file`), so a named pipe, a
    device, a /proc file that would block, or a path swapped after the check is refused, not read."""
    from ..media.local_files import read_regular_file

    if policy.allowed_local_path is None:
        raise InputError(f"{what}: local files are refused (the server was started without "
                         f"--allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InputError(f"{what}: file URLs must name a local path (file:///...)")
    raw = unquote(parts.path)
    if "\x00" in raw:
        raise InputError(f"{what}: the file URL contains a NUL character (%00)")
    if not raw.startswith("/"):  # `file:a.png` would resolve against the server's working directory
        raise InputError(f"{what}: file URLs must name an absolute path (file:///...), not {raw!r}")
    root = Path(policy.allowed_local_path).resolve()
    try:
        path = Path(raw).resolve()
    except (OSError, ValueError) as e:
        raise InputError(f"{what}: not a usable local path ({type(e).__name__})") from None
    # messages name the path the client sent: the resolved one may be a symlink's target outside the root
    if not path.is_relative_to(root):
        raise InputError(f"{what}: {raw} resolves outside the allowed local media path {policy.allowed_local_path}")
    cap = max_bytes or policy.max_bytes

    def too_big(size):
        return InputError(f"{what}: {raw} is {size} bytes, over the {cap}-byte media cap" if size is not None
                          else f"{what}: {raw} is over the {cap}-byte media cap")

    return read_regular_file(path, f"{what}: {raw}", cap, too_big, follow_symlinks=False, inside=root)


async def _read_local(url: str, policy: MediaPolicy, what: str, max_bytes: int | None = None) -> bytes:
    """`read_local` off the event loop, within the media timeout (a file system that hangs, e.g. a dead
    network mount, fails this request instead of stalling the server)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(read_local, url, policy, what, max_bytes), policy.timeout_s)
    except asyncio.TimeoutError:
        raise InputError(f"{what}: reading {url} took longer than {policy.timeout_s:g}s") from None


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def _checked_addresses(host: str, port: int, policy: MediaPolicy, what: str) -> list[str]:
    """The addresses `host` resolves to, every one of them allowed, IPv4 first."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"{what}: cannot resolve {host!r} ({e})") from None
    addrs = list(dict.fromkeys(info[4][0] for info in infos))
    if not addrs:
        raise InputError(f"{what}: {host!r} has no address")
    if not policy.allow_private_addresses:
        for a in addrs:
            if not _public(ipaddress.ip_address(a.split("%", 1)[0])):
                raise InputError(f"{what}: {host!r} resolves to {a}, a loopback, private, link-local or reserved "
                                 "address (start the server with --allow-private-media-addresses to allow it)")
    return sorted(addrs, key=lambda a: ":" in a)


async def _get(client, url: str, addr: str, policy: MediaPolicy, what: str,
               max_bytes: int | None = None) -> tuple[str | None, bytes, str]:
    """One GET of `url` connected to `addr`: (redirect location, b"", "") or (None, body, content type)."""
    import httpx

    parts = urlsplit(url)
    # The connection goes to the checked address; the Host header and TLS (SNI, certificate) keep the name.
    target = httpx.URL(url).copy_with(host=addr)
    headers = {"Host": parts.netloc.rsplit("@", 1)[-1]}
    ext = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    async with client.stream("GET", target, headers=headers, extensions=ext) as resp:
        if resp.is_redirect and "location" in resp.headers:
            return urljoin(url, resp.headers["location"]), b"", ""
        if resp.status_code != 200:
            raise InputError(f"{what}: fetching {url} returned HTTP {resp.status_code}")
        cap = max_bytes or policy.max_bytes
        declared = resp.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise InputError(f"{what}: {url} is {declared} bytes, over the {cap}-byte media cap")
        buf = bytearray()
        async for chunk in resp.aiter_bytes():
            buf += chunk
            if len(buf) > cap:
                raise InputError(f"{what}: {url} is over the {cap}-byte media cap")
        return None, bytes(buf), resp.headers.get("content-type", "")


async def _fetch(url: str, policy: MediaPolicy, what: str, client, max_bytes: int | None = None,
                 info: dict | None = None) -> bytes:
    import httpx

    sent = url
    for hop in range(MAX_REDIRECTS + 1):
        # after a redirect, a refusal names the URL the client sent and where it led
        via = f"{sent} redirected to {url[:200]}: " if hop else ""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise InputError(f"{what}: {sent} redirected to a {parts.scheme!r} URL (only http and https are followed)")
        if not policy.host_allowed(parts.hostname):
            allowed = ", ".join(policy.allowed_domains) or "none (use --allowed-media-domains)"
            raise InputError(f"{what}: {via}fetching media from {parts.hostname!r} is not allowed "
                             f"(allowed hosts: {allowed})")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InputError(f"{what}: {via}invalid port in {url!r}") from None
        try:
            addrs = await _checked_addresses(parts.hostname, port, policy, what)
        except InputError as e:
            if not hop:
                raise
            raise InputError(f"{what}: {via}{e.message[len(what) + 2:]}") from None
        try:
            for i, addr in enumerate(addrs):
                try:
                    location, body, ctype = await _get(client, url, addr, policy, what, max_bytes)
                    break
                except httpx.ConnectError:
                    if i == len(addrs) - 1:  # every address of the host refused
                        raise
        except httpx.TimeoutException:
            raise InputError(f"{what}: fetching {url} timed out after {policy.timeout_s:g}s") from None
        except httpx.HTTPError as e:
            raise InputError(f"{what}: fetching {url} failed ({type(e).__name__}: {e})") from None
        if location is None:
            if info is not None:
                info["content_type"] = ctype
            return body
        url = location
    raise InputError(f"{what}: {sent}: too many redirects (more than {MAX_REDIRECTS})")


async def fetch_remote(url: str, policy: MediaPolicy, what: str, client=None, max_bytes: int | None = None,
                       info: dict | None = None) -> bytes:
    """The body of an http(s) media URL under `policy` (`max_bytes`: a cap other than the image cap);
    `timeout_s` bounds the whole fetch, not each read. `info`, when given, gets the response's
    `content_type`."""
    import httpx

    own = client is None
    if own:
        client = httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False, trust_env=False)
    try:
        return await asyncio.wait_for(_fetch(url, policy, what, client, max_bytes, info), policy.timeout_s)
    except asyncio.TimeoutError:
        raise InputError(f"{what}: fetching {url} took longer than {policy.timeout_s:g}s") from None
    finally:
        if own:
            await client.aclose()


def _not_media(e: InputError, url: str, info: dict, kind: str, what: str) -> InputError:
    """A fetched body that did not decode: when the server said it is something else (an HTML error
    page, JSON), say so, naming the URL; else the decoder's own error."""
    ctype = (info.get("content_type") or "").split(";", 1)[0].strip().lower()
    if not ctype or ctype.startswith(f"{kind}/") or ctype in ("application/octet-stream", "binary/octet-stream"):
        return e
    return InputError(f"{what}: {url} sent Content-Type {ctype!r}: {e.message[len(what) + 2:]}")


async def load_image_url(url: str, policy: MediaPolicy, what: str = "image", client=None,
                         limits: ImageLimits | None = None):
    """An image_url (data:, http(s):, file:) -> RGB PIL image. Decoding runs off the event loop."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    info: dict = {}
    if scheme == "data":
        data = parse_data_url(url, what)
    elif scheme in ("http", "https"):
        data = await fetch_remote(url, policy, what, client, info=info)
    elif scheme == "file":
        data = await _read_local(url, policy, what)
    else:
        raise InputError(f"{what}: unsupported image URL (use a data:, http(s): or file: URL)")
    if len(data) > policy.max_bytes:
        raise InputError(f"{what}: {len(data)} bytes, over the {policy.max_bytes}-byte media cap")
    try:
        return await asyncio.to_thread(decode_image, data, what, limits)
    except LimitError:
        raise
    except InputError as e:
        raise _not_media(e, url, info, "image", what) from None


async def load_video_url(url: str, policy: MediaPolicy, what: str = "video", client=None):
    """A video_url (data:, http(s):, file:) -> a probed media.video.Video, under the same policy as
    images with the video byte cap. Probing runs off the event loop; frames are decoded at encode."""
    from ..media.video import Video

    cap = policy.max_video_bytes
    info: dict = {}
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = parse_data_url(url, what, kind="video")
    elif scheme in ("http", "https"):
        data = await fetch_remote(url, policy, what, client, max_bytes=cap, info=info)
    elif scheme == "file":
        data = await _read_local(url, policy, what, max_bytes=cap)
    else:
        raise InputError(f"{what}: unsupported video URL (use a data:, http(s): or file: URL)")
    if len(data) > cap:
        raise InputError(f"{what}: {len(data)} bytes, over the {cap}-byte video cap")
    try:
        return await asyncio.to_thread(Video, data, what)
    except LimitError:
        raise
    except InputError as e:
        raise _not_media(e, url, info, "video", what) from None
