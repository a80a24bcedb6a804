"""What ``paravt api`` accepts: its settings, its error type, and an OpenAI chat request read as one question
about one video (:func:`parse_request`, :func:`resolve_video`). See :mod:`paravt_agent.serving.api` for the endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paravt_agent.protocol import split_options
from paravt_agent.video.fetch import local_video

__all__ = ["MODES", "ApiError", "ApiSettings", "Question", "parse_request", "resolve_video"]

MODES = ("parallel", "sequential", "none", "collaborative")


@dataclass
class ApiSettings:
    """How the endpoint admits and checks requests (``paravt api --help`` documents each)."""

    model_name: str = "paravt"
    video_root: str | None = None
    api_key: str | None = None
    #: API keys mapped to principals: a keys file, or "store" (:mod:`paravt_agent.serving.keys`); None: every caller
    #: is one principal (the ``api_key``'s holder, or anonymous)
    keys: str | None = None
    max_concurrent: int = 32
    max_queue: int = 64
    max_request_bytes: int = 1 << 20
    max_download_bytes: int = 2 << 30
    download_timeout: float = 300.0
    max_turns_limit: int = 8
    download_dir: str | None = None
    allow_url_prefixes: tuple[str, ...] = ()
    #: an answer built on failed tool calls (``paravt.status`` "degraded"): ``answer`` (200 with the answer,
    #: ``paravt.ok`` false and the failures listed) or ``error`` (502 ``degraded_answer``, the answer in ``paravt``)
    degraded: str = "answer"
    extra: dict = field(default_factory=dict)


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": None}}


# --------------------------------------------------------------------------- request parsing


@dataclass
class Question:
    video: str  # as the client gave it (a path under the root, or an http(s) URL)
    question: str
    options: list[str] | None
    n_frames: int | None
    max_turns: int | None
    mode: str | None
    stream: bool
    include_usage: bool


def _parts(content) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, "message content must be a string or a list of content parts")
    return content


def _video_of(part: dict) -> str | None:
    kind = part.get("type")
    if kind == "video_url":
        v = part.get("video_url")
        url = v.get("url") if isinstance(v, dict) else v
        if not isinstance(url, str) or not url:
            raise ApiError(400, "a video_url part needs video_url.url")
        return url
    if kind == "video":
        v = part.get("video")
        if not isinstance(v, str) or not v:
            raise ApiError(400, "a video part needs a path or URL in `video`")
        return v
    return None


def parse_request(body: Any, settings: ApiSettings) -> Question:
    """The question, the video and the run's settings from a chat-completions body (400s on bad input)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model not in (None, "", settings.model_name):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {settings.model_name!r}",
                       code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ApiError(400, "no user message: the last user message holds the question and the video")
    texts, video = [], None
    for part in _parts(users[-1].get("content")):
        if not isinstance(part, dict):
            raise ApiError(400, "each content part must be an object")
        v = _video_of(part)
        if v is not None:
            if video is not None:
                raise ApiError(400, "one video per question: the message has more than one video part")
            video = v
        elif part.get("type") == "text":
            texts.append(str(part.get("text") or ""))
        elif part.get("type") in ("image_url", "input_audio", "audio_url"):
            raise ApiError(400, f"{part['type']} parts are not supported: send the video as a video_url part")
    if video is None:  # a follow-up question: the conversation's latest video
        for m in reversed(users[:-1]):
            for part in _parts(m.get("content")):
                if isinstance(part, dict) and (v := _video_of(part)) is not None:
                    video = v
            if video is not None:
                break
    if video is None:
        raise ApiError(400, 'no video: add a {"type": "video_url", "video_url": {"url": ...}} content part')
    question, options = split_options("\n".join(t for t in texts if t.strip()))
    if body.get("options") is not None:
        opts = body["options"]
        if not isinstance(opts, list) or len(opts) < 2 or not all(isinstance(o, str) and o.strip() for o in opts):
            raise ApiError(400, "`options` must be a list of at least two non-empty strings")
        options = [o.strip() for o in opts]
    if not question:
        raise ApiError(400, "the question is empty: put it in a text part of the last user message")

    def _int(name: str, low: int, high: int) -> int | None:
        v = body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ApiError(400, f"`{name}` must be an integer in [{low}, {high}]", code=f"invalid_{name}")
        return v

    mode = body.get("mode")
    if mode is not None and mode not in MODES:
        raise ApiError(400, f"`mode` must be one of {', '.join(MODES)}", code="invalid_mode")
    opts_ = body.get("stream_options") or {}
    return Question(video=video, question=question, options=options, n_frames=_int("n_frames", 1, 64),
                    max_turns=_int("max_turns", 1, settings.max_turns_limit), mode=mode,
                    stream=bool(body.get("stream")), include_usage=bool(opts_.get("include_usage", False)))


def resolve_video(video: str, settings: ApiSettings) -> str:
    """A readable local path for the request's video, or an ApiError (what is refused and why)."""
    low = video.lower()
    if low.startswith(("http://", "https://")):
        return local_video(video, cache=settings.download_dir, max_bytes=settings.max_download_bytes,
                           timeout=settings.download_timeout, allow_prefixes=settings.allow_url_prefixes)
    if "://" in video[:16] or low.startswith("data:"):
        raise ApiError(400, f"{video[:40]!r}: only paths under the server's video root and http(s) URLs are accepted",
                       code="invalid_video")
    if not settings.video_root:
        raise ApiError(400, "this server accepts http(s) video URLs only (it was started without --video-root)",
                       code="invalid_video")
    root = Path(settings.video_root).resolve()
    path = (root / video.lstrip("/")).resolve() if not Path(video).is_absolute() else Path(video).resolve()
    if path != root and root not in path.parents:
        raise ApiError(400, f"{video!r} is outside the server's video root", code="invalid_video")
    if not path.is_file():
        raise ApiError(404, f"{video!r}: no such video under the server's video root", code="video_not_found")
    return str(path)


