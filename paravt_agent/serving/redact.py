"""What ``paravt api`` tells a client never holds the server's own files: a video is named as the client sent it
(``talks/t1.mp4``, never ``/srv/videos/talks/t1.mp4``), the video root, the download cache and the trajectory store
by what they are, and any other absolute path that exists on the server as ``<server path>``.

:class:`ClientView` does it for one request (it knows which server path is the client's upload); every error the
app answers passes through one (routes, the app's error handlers, stream events), and so does the ``paravt``
extension of a reply (its errors and warnings come from the runtime, which works on server paths).
"""

from __future__ import annotations

import os
import re

from paravt_agent.serving.request import ApiError, ApiSettings

__all__ = ["ClientView"]

#: an absolute POSIX path standing on its own (not the path part of a URL: no word character, ':' or '/' before it)
_ABSOLUTE = re.compile(r"(?<![\w:/.\-~])/(?:[\w.@+\-]+/)+[\w.@+\-]+")


def _on_server(path: str) -> bool:
    """Whether ``path`` names something of this machine's (itself or its folder exists)."""
    return os.path.exists(path) or os.path.isdir(os.path.dirname(path))


class ClientView:
    """Server paths in a text, said as the client knows them (see the module)."""

    def __init__(self, settings: ApiSettings, path: str | None = None, video: str | None = None,
                 store_url: str | None = None):
        names: dict[str, str] = {}
        if path and video:  # the upload: as the client sent it
            for p in {path, os.path.realpath(path), os.path.abspath(path)}:
                names[p] = video
        if settings.video_root:
            for p in {settings.video_root, os.path.realpath(settings.video_root)}:
                names[p.rstrip("/") or "/"] = "<video root>"
        if settings.download_dir:
            names[os.path.realpath(settings.download_dir)] = "<download cache>"
        if store_url:
            names[store_url] = "the trajectory store"
        self._names = sorted(names.items(), key=lambda kv: -len(kv[0]))  # the longest first: a file before its root

    def text(self, text: str) -> str:
        if not text:
            return text
        kept: list[str] = []
        for server, client in self._names:  # standing on its own, as _ABSOLUTE (never inside a client's URL)
            pattern = re.compile(r"(?<![\w:/.\-~])" + re.escape(server) + r"(?![\w.@+\-])")
            text, n = pattern.subn(f"\x00{len(kept)}\x00", text)
            if n:
                kept.append(client)
        text = _ABSOLUTE.sub(lambda m: "<server path>" if _on_server(m.group(0)) else m.group(0), text)
        return re.sub(r"\x00(\d+)\x00", lambda m: kept[int(m.group(1))], text)

    def data(self, obj):
        """``obj`` (JSON-like) with every string said as :meth:`text` says it."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {k: self.data(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.data(v) for v in obj]
        return obj

    def error(self, err: ApiError) -> ApiError:
        return ApiError(err.status, self.text(err.message), err.kind, err.code, err.headers)
