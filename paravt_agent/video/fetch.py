"""Videos given by URL: downloaded once, with a size and a time limit, into the cache — never from the
operator's own network unless they open it.

``http(s)://`` URLs are fetched into ``$PARAVT_HOME/downloads`` (named by the URL's hash, reused while
the file is there); anything else that looks like a URL (``file://``, ``ftp://``) is refused, and a local
path is returned as it is.

Every host is resolved before the download and refused when any of its addresses is not a public one
(loopback, private, link-local, multicast, reserved, unspecified, shared, or an IPv6 form that embeds such an
IPv4 address); the connection then goes to the address that was checked (the ``Host`` header and TLS name
stay the URL's), so a second DNS answer cannot point it elsewhere. Redirects are followed by hand (at most
5), each hop checked the same way. An operator opens what they choose with URL prefixes
(``allow_prefixes``, ``paravt api --allow-url-prefix``, or ``PARAVT_ALLOW_URL_PREFIXES``, space-separated):
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
from urllib.parse import urljoin, urlsplit

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


def _under(url: str, prefix: str) -> bool:
    """``url`` lies under ``prefix`` at a boundary (``http://a.com`` does not open ``http://a.com.evil``)."""
    if not url.lower().startswith(prefix.lower()):
        return False
    rest = url[len(prefix):]
    return not rest or prefix.endswith("/") or rest[0] in "/?#"


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    out = [ip.sixtofour] if ip.sixtofour is not None else []
    if ip.teredo:
        out += list(ip.teredo)
    if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64: the last 32 bits are the IPv4 address
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def address_refusal(address: str) -> str | None:
    """Why a client may not make the server connect to ``address`` (``None``: a public address)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return address_refusal(str(ip.ipv4_mapped))
    for kind in ("loopback", "unspecified", "link_local", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
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


def check_url(url: str, allow: Sequence[str] = ()) -> str | None:
    """Refuse ``url`` unless it is http(s) and either under an allowed prefix or every address of its host is
    public. Returns the address to connect to (``None`` for an allowed URL: connect as usual)."""
    if not url.lower().startswith(SCHEMES):
        raise VideoError(f"{url}: only local files and http(s) URLs are supported")
    if any(_under(url, p) for p in allow):
        return None
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        raise VideoError(f"{url}: the URL has no host")
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise VideoError(f"{url}: the URL's port is not a number in [0, 65535]") from None
    addresses = _resolve(host, port)
    for a in addresses:
        why = address_refusal(a)
        if why:
            raise VideoError(f"{url}: {host} is a {why} address ({a}); this server does not fetch from its own "
                             f"network (an operator can open a prefix with --allow-url-prefix or ${ALLOW_ENV})")
    return addresses[0]


def _pinned(url: str, address: str | None) -> tuple[str, dict, dict]:
    """The request for ``url`` sent to ``address``: the URL with the address as host, the URL's Host header and
    TLS server name."""
    if address is None:
        return url, {}, {}
    parts = urlsplit(url)
    ip = ipaddress.ip_address(address.split("%")[0])
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    netloc = host + (f":{parts.port}" if parts.port else "")
    target = parts._replace(netloc=netloc).geturl()
    host_header = parts.hostname + (f":{parts.port}" if parts.port else "")
    ext = {"sni_hostname": parts.hostname} if parts.scheme.lower() == "https" else {}
    return target, {"Host": host_header}, ext


def local_video(video, cache: str | Path | None = None, max_bytes: int = MAX_DOWNLOAD_BYTES,
                timeout: float = 300.0, allow_prefixes: Sequence[str] | None = None) -> str:
    """A local path for ``video``: the path itself, or an http(s) URL's download (see the module's rules)."""
    if not is_url(video):
        return os.fspath(video)
    import httpx

    from paravt_agent.defaults import paravt_home

    allow = allowed_prefixes(allow_prefixes)
    address = check_url(video, allow)
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
        with httpx.Client(timeout=min(timeout, 30.0), follow_redirects=False, trust_env=False) as client:
            for hop in range(MAX_REDIRECTS + 1):
                req_url, headers, ext = _pinned(url, address)
                with client.stream("GET", req_url, headers=headers, extensions=ext) as resp:
                    if resp.is_redirect and "location" in resp.headers:
                        if hop == MAX_REDIRECTS:
                            raise VideoError(f"{video}: more than {MAX_REDIRECTS} redirects")
                        url = urljoin(url, resp.headers["location"])
                        address = check_url(url, allow)
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
