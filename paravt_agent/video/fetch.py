"""Videos given by URL: downloaded once, with a size and a time limit, into the cache — never from the
operator's own network unless they open it.

``http(s)://`` URLs are fetched into ``$PARAVT_HOME/downloads`` (named by the URL's hash, reused while
the file is there); anything else that looks like a URL (``file://``, ``ftp://``) is refused, and a local
path is returned as it is.

Every host is resolved before the download and refused when any of its addresses is not a public one
(loopback, private, link-local, multicast, reserved, unspecified, shared, or an IPv6 form that embeds such an
IPv4 address); the connection then goes to the address that was checked (the ``Host`` header and TLS name
stay the URL's), so a second DNS answer cannot point it elsewhere; proxies from the environment are not
used, for the same reason. Redirects are followed by hand (at most 5), each hop checked the same way. An operator
opens what they choose with URL prefixes
(``allow_prefixes``, ``paravt api --allow-url-prefix``, ``paravt answer --allow-url-prefix``, or
``PARAVT_ALLOW_URL_PREFIXES``, space-separated):
a URL under one of them is fetched wherever it points.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urljoin

from paravt_agent.defaults import paravt_home
from paravt_agent.errors import VideoError

__all__ = ["ALLOW_ENV", "MAX_DOWNLOAD_BYTES", "MAX_REDIRECTS", "address_refusal", "allowed_prefixes", "check_url",
           "is_url", "local_video"]

MAX_DOWNLOAD_BYTES = 2 << 30  # 2 GiB
MAX_REDIRECTS = 5
SCHEMES = ("http://", "https://")
ALLOW_ENV = "PARAVT_ALLOW_URL_PREFIXES"


def is_url(video) -> bool:
    return isinstance(video, str) and "://" in video[:16]


def allowed_prefixes(extra: Sequence[str] | None = None) -> tuple[str, ...]:
    """The operator's allow-list: ``extra`` and ``$PARAVT_ALLOW_URL_PREFIXES``."""
    return tuple(p for p in (*(extra or ()), *os.environ.get(ALLOW_ENV, "").split()) if p)


def _origin(u) -> tuple[str, str, int]:
    return u.scheme, u.raw_host.decode("ascii").lower(), u.port or (443 if u.scheme == "https" else 80)


def _under(url: str, prefix: str) -> bool:
    """``url`` lies under ``prefix``: the same scheme, host and port, and a path under the prefix's once both are
    normalised (``/videos/../admin`` is ``/admin``; ``http://a.com`` does not open ``http://a.com.evil``). A path
    with encoded dots or slashes, which some servers decode, is under no prefix."""
    import httpx

    try:
        u, p = httpx.URL(url), httpx.URL(prefix)
    except (httpx.InvalidURL, UnicodeError, ValueError):
        return False
    if not p.raw_host or _origin(u) != _origin(p):
        return False
    raw = u.raw_path.split(b"?")[0].lower()
    if any(x in raw for x in (b"%2e", b"%2f", b"%5c")):
        return False
    want = p.path
    return want in ("", "/") or u.path == want or u.path.startswith(want if want.endswith("/") else want + "/")


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (6to4, Teredo; NAT64's 64:ff9b::/96 is reserved, so refused)."""
    out = [ip.sixtofour] if ip.sixtofour is not None else []
    if ip.teredo:
        out += list(ip.teredo)
    return out


def address_refusal(address: str) -> str | None:
    """Why a client may not make the server connect to ``address`` (``None``: a public address)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return address_refusal(str(ip.ipv4_mapped))
    for kind in ("loopback", "unspecified", "link_local", "site_local", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{kind}", False):
            return kind.replace("_", "-")
    if not ip.is_global:
        return "non-public"
    if isinstance(ip, ipaddress.IPv6Address):
        for v4 in _embedded_v4(ip):
            why = address_refusal(str(v4))
            if why:
                return f"{why} (embedded in {ip})"
    return None


def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise VideoError(f"cannot resolve {host}: {exc}") from None
    return list(dict.fromkeys(i[4][0] for i in infos))


def check_url(url: str, allow: Sequence[str] = ()) -> list[str | None]:
    """Refuse ``url`` unless it is http(s) and either under an allowed prefix or every address of its host is
    public. Returns the addresses to connect to, in order (``[None]`` for an allowed URL: connect as usual)."""
    import httpx

    if not url.lower().startswith(SCHEMES):
        raise VideoError(f"{url}: only local files and http(s) URLs are supported")
    if any(_under(url, p) for p in allow):
        return [None]
    try:
        u = httpx.URL(url)
        host = u.raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
        raise VideoError(f"{url}: not a valid URL ({exc})") from None
    if not host:
        raise VideoError(f"{url}: the URL has no host")
    addresses = _resolve(host, _origin(u)[2])
    if not addresses:
        raise VideoError(f"cannot resolve {host}")
    for a in addresses:
        why = address_refusal(a)
        if why:
            raise VideoError(f"{url}: {u.host} is a {why} address ({a}); videos are not fetched from the "
                             f"machine's own network unless a URL prefix is opened: `paravt answer "
                             f"--allow-url-prefix PREFIX`, `paravt api --allow-url-prefix PREFIX`, or ${ALLOW_ENV} "
                             "(space-separated prefixes; the SDK reads it too)")
    return addresses


def _pinned(url: str, address: str | None) -> tuple[str, dict, dict]:
    """The request for ``url`` sent to ``address``: the URL with the address as its host, and the URL's own
    ``Host`` header and TLS server name (IDNA-encoded)."""
    if address is None:
        return url, {}, {}
    import httpx

    u = httpx.URL(url)
    target = u.copy_with(host=str(ipaddress.ip_address(address.split("%")[0])))
    host = u.raw_host.decode("ascii")
    ext = {"sni_hostname": host} if u.scheme == "https" and not _is_ip(host) else {}
    return str(target), {"Host": u.netloc.decode("ascii")}, ext


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _open(client, url: str, addresses: list[str | None]):
    """A streamed GET of ``url``, trying each checked address in turn until one connects."""
    import httpx

    for k, address in enumerate(addresses):
        req_url, headers, ext = _pinned(url, address)
        try:
            return client.send(client.build_request("GET", req_url, headers=headers, extensions=ext), stream=True)
        except httpx.ConnectError:
            if k == len(addresses) - 1:
                raise
    raise AssertionError("unreachable")


def local_video(video, cache: str | Path | None = None, max_bytes: int = MAX_DOWNLOAD_BYTES,
                timeout: float = 300.0, allow_prefixes: Sequence[str] | None = None) -> str:
    """A local path for ``video``: the path itself, or an http(s) URL's download (see the module's rules)."""
    if not is_url(video):
        return os.fspath(video)
    import httpx


    allow = allowed_prefixes(allow_prefixes)
    addresses = check_url(video, allow)
    folder = Path(cache or paravt_home() / "downloads")
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(video.encode()).hexdigest()[:24] + Path(video.split("?")[0]).suffix[:8]
    target = folder / name
    if target.is_file() and target.stat().st_size > 0:
        return str(target)
    tmp = target.with_suffix(target.suffix + ".part")
    deadline = time.monotonic() + timeout
    got = 0
    url = video
    try:
        # no proxies from the environment: the connection must go to the address that was checked
        with httpx.Client(timeout=min(timeout, 30.0), follow_redirects=False, trust_env=False) as client:
            for hop in range(MAX_REDIRECTS + 1):
                resp = _open(client, url, addresses)
                try:
                    if resp.is_redirect and "location" in resp.headers:
                        if hop == MAX_REDIRECTS:
                            raise VideoError(f"{video}: more than {MAX_REDIRECTS} redirects")
                        url = urljoin(url, resp.headers["location"])
                        addresses = check_url(url, allow)
                        continue
                    if resp.status_code != 200:
                        raise VideoError(f"{video}: the server answered HTTP {resp.status_code}")
                    size = int(resp.headers.get("content-length") or 0)
                    if size > max_bytes:
                        raise VideoError(f"{video}: {size} bytes is over the {max_bytes}-byte download limit")
                    with tmp.open("wb") as f:
                        for chunk in resp.iter_bytes(1 << 20):
                            got += len(chunk)
                            if got > max_bytes:
                                raise VideoError(f"{video}: over the {max_bytes}-byte download limit")
                            if time.monotonic() > deadline:
                                raise VideoError(f"{video}: the download took longer than {timeout:g}s")
                            f.write(chunk)
                    break
                finally:
                    resp.close()
    except httpx.HTTPError as exc:
        tmp.unlink(missing_ok=True)
        raise VideoError(f"{video}: cannot download it ({exc})") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if got == 0:
        tmp.unlink(missing_ok=True)
        raise VideoError(f"{video}: the download is empty")
    tmp.rename(target)
    return str(target)
