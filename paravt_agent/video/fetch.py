"""Videos given by URL: downloaded once, with a size and a time limit, into the cache.

``http(s)://`` URLs are fetched into ``$PARAVT_HOME/downloads`` (named by the URL's hash, reused while
the file is there); anything else that looks like a URL (``file://``, ``ftp://``) is refused, and a local
path is returned as it is.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from paravt_agent.errors import VideoError

__all__ = ["MAX_DOWNLOAD_BYTES", "is_url", "local_video"]

MAX_DOWNLOAD_BYTES = 2 << 30  # 2 GiB
SCHEMES = ("http://", "https://")


def is_url(video) -> bool:
    return isinstance(video, str) and "://" in video[:16]


def local_video(video, cache: str | Path | None = None, max_bytes: int = MAX_DOWNLOAD_BYTES,
                timeout: float = 300.0) -> str:
    """A local path for ``video``: the path itself, or an http(s) URL's download."""
    if not is_url(video):
        return os.fspath(video)
    if not video.lower().startswith(SCHEMES):
        raise VideoError(f"{video}: only local files and http(s) URLs are supported")
    import httpx

    from paravt_agent.defaults import paravt_home

    folder = Path(cache or paravt_home() / "downloads")
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(video.encode()).hexdigest()[:24] + Path(video.split("?")[0]).suffix[:8]
    target = folder / name
    if target.is_file() and target.stat().st_size > 0:
        return str(target)
    tmp = target.with_suffix(target.suffix + ".part")
    deadline = time.monotonic() + timeout
    got = 0
    try:
        with httpx.stream("GET", video, timeout=min(timeout, 30.0), follow_redirects=True) as resp:
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
