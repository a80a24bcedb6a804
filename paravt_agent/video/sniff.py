"""What a file that is not a video is, from its first bytes (its magic number), so that a refusal says what is wrong
with the file instead of passing on FFmpeg's ``InvalidDataError: [Errno 1094995529] Invalid data found when
processing input``.

Only kinds that are certainly not videos are named (text, images, documents, archives, programs); anything else is
left to the decoder, which opens far more containers than a list here could (a GIF, an MPEG stream, a raw H.264
file all decode).
"""

from __future__ import annotations

import os

from paravt_agent.errors import VideoError

__all__ = ["HEAD_BYTES", "describe_not_video", "explain_unreadable", "refuse_not_video"]

#: how much of a file is read to tell what it is
HEAD_BYTES = 512

#: (offset, magic bytes, what the file is)
_MAGIC = (
    (0, b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (0, b"\xff\xd8\xff", "a JPEG image"),
    (0, b"BM", None),  # a BMP image only with a plausible header (checked below): "BM" starts many texts
    (0, b"%PDF-", "a PDF document"),
    (0, b"PK\x03\x04", "a ZIP archive (or a document stored as one: docx, xlsx, odt, ...)"),
    (0, b"\x1f\x8b", "a gzip archive"),
    (0, b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (0, b"Rar!\x1a\x07", "a RAR archive"),
    (0, b"\x7fELF", "a program (an ELF executable)"),
    (0, b"SQLite format 3\x00", "an SQLite database"),
    (0, b"PAR1", "a Parquet file"),
    (8, b"WEBP", "a WebP image"),
)


def _text_kind(head: bytes) -> str | None:
    """``head`` as text (UTF-8 or UTF-16 with a byte-order mark), named by what it looks like, or None."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "a text file (UTF-16)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a multi-byte character cut at the end of the head is still text
        if exc.start < len(head) - 3:
            return None
        text = head[: exc.start].decode("utf-8")
    if not text or sum(c.isprintable() or c in "\r\n\t" for c in text) < 0.95 * len(text):
        return None
    start = text.lstrip().lower()
    if start.startswith(("<!doctype html", "<html")):
        return "an HTML page (a download that returned a web page?)"
    if start.startswith("<?xml"):
        return "an XML document"
    if start.startswith(("{", "[")):
        return "a JSON document"
    first = " ".join(text.split())[:40]
    return f"a text file (it begins {first!r})"


def describe_not_video(path: str | os.PathLike) -> str | None:
    """What the file at ``path`` is when its first bytes say it is certainly not a video (``"a PNG image"``,
    ``"a text file (it begins 'hello')"``), else None (a video, or a kind the decoder has to judge)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return None
    for offset, magic, what in _MAGIC:
        if head[offset:offset + len(magic)] != magic:
            continue
        if magic == b"BM":
            if len(head) >= 26 and int.from_bytes(head[2:6], "little") == os.path.getsize(path):
                return "a BMP image"
            continue
        if magic == b"WEBP" and not head.startswith(b"RIFF"):
            continue
        return what
    return _text_kind(head)


def explain_unreadable(path: str, name: str, detail: str) -> str:
    """The message for a file the decoder could not open: what the file is when its bytes tell (:func:`describe_not
    _video`), else that no video container was recognised, with the decoder's own words last. ``name`` is the file as
    the caller knows it (a server names the client's upload, never its own path)."""
    try:
        refuse_not_video(path, name)
    except VideoError as exc:
        return str(exc)
    try:
        with open(path, "rb") as f:
            head = f.read(8).hex(" ")
    except OSError:
        head = "?"
    return (f"{name}: no video container was recognised in it (it begins with the bytes {head}): the file is damaged, "
            f"cut short or not a video ({detail})")


def refuse_not_video(path: str, name: str | None = None) -> None:
    """Raise :class:`VideoError` saying what the file is when its first bytes say it is certainly not a video
    (before any decoder opens it: FFmpeg opens an image as a one-frame stream and a text file as ANSI art)."""
    what = describe_not_video(path)
    if what is not None:
        raise VideoError(f"{name or path}: this is {what}, not a video; give a video file (mp4, mkv, webm, mov, avi, "
                         "...)")
