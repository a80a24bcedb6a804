"""The one interface every model backend implements (ARCHITECTURE.md, decision 3).

``await policy.generate(messages, sampling, prefix="<think>\\n", continuation=...) -> Generation``.
Messages are plain dicts in one neutral layout that every backend converts to its own wire format::
    {"role": "system" | "user" | "assistant", "content": str | [part, ...]}
    part = {"type": "text", "text": str}
         | {"type": "image", "image": np.ndarray (H, W, 3) uint8, "timestamp": float}

A new backend subclasses :class:`Policy` and registers a factory in
:mod:`paravt_agent.policy.registry` (or through the ``paravt.policies`` entry-point group).
Backends that tokenise on the client share :mod:`paravt_agent.policy.chat`.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import inspect
import io
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from paravt_agent.policy.families import box_coordinates_of, geometry_of_dir, model_type_of_dir
from paravt_agent.types import Continuation, Generation, Sampling
from paravt_agent.video.geometry import FrameGeometry

__all__ = ["SERVE_CLOCK", "Continuation", "box_coordinates_of", "model_type_of_dir", "Generation", "Policy", "Sampling",
           "ServeClock", "being_served", "encode_image", "images_of", "map_images", "takes_role", "text_of"]


class Policy(ABC):
    """The model behind the graph. Implementations must be safe to call concurrently from one event loop.

    ``prefix`` is forced as the start of the response (the paper's think prefix); a backend that cannot
    force it must raise :class:`~paravt_agent.errors.PolicyError` rather than ignore it.
    ``continuation`` (a token backend's business) says which earlier assistant turn the conversation
    continues token for token. ``role`` says who calls: ``planner``, ``subagent`` (a sub-agent of the same
    weights) or ``tool:<name>``; a backend may ignore it (one written before it existed may omit the
    parameter: the graph passes it only to backends whose ``generate`` takes it).
    """

    name: str = "policy"
    #: whether ``generate`` returns token ids and logprobs (what RL training needs)
    returns_tokens: bool = False
    #: whether ``generate`` calls :func:`being_served` when the request leaves this backend's own queue (the
    #: local batcher takes it into a batch; an HTTP client gets one of its connection slots). Time a call spends
    #: queued before that is not counted against the agent's timeouts; a backend that does not report it has
    #: its whole call counted as work.
    reports_service: bool = False
    #: whether the endpoint behind this policy takes weights pushed by a trainer (SGLang's admin API)
    receives_weights: bool = False

    @property
    def supports_prefix(self) -> bool:
        """Whether this backend can force a response prefix (the think prefix)."""
        return True

    @abstractmethod
    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None, role: str = "planner") -> Generation: ...

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """Token ids this backend never samples (the vision placeholders, banned with ``chat.ban`` or SGLang's
        ``logit_bias``), where it tokenises here. The trainer scores them as banned whatever a backend says."""
        return ()

    def prompt_token_bound(self, messages: list[dict]) -> int | None:
        """An upper bound of the prompt's tokens computed without encoding it, where the backend can."""
        return None

    def count_tokens(self, messages: list[dict]) -> int | None:
        """Prompt length in tokens, where the backend can tell without generating."""
        return None

    def count_text_tokens(self, text: str) -> int | None:
        """Tokens of ``text`` alone, where the backend has the model's tokenizer here."""
        return None

    @property
    def context_length(self) -> int | None:
        """The model's context window in tokens, where the backend knows it."""
        return None

    @property
    def model_type(self) -> str | None:
        """The model's family as its config names it (``qwen3_vl``, ``qwen2_5_vl``, ...), where the backend can tell:
        a local model's config, a served model directory's config.json, or the served model's name."""
        name = vars(self).get("model") or vars(self).get("path")  # attributes, never a property that loads a model
        if not isinstance(name, str) or not name:
            return None
        return model_type_of_dir(name) or name.rstrip("/").rsplit("/", 1)[-1].lower()

    @property
    def frame_geometry(self) -> FrameGeometry | None:
        """The frame geometry of the model behind this policy (its unit, pixel bounds and box convention:
        :mod:`paravt_agent.policy.families`), where the backend can read it; by default from a model directory's
        processor files. None when unknown: the frame protocol then keeps the unit a config states."""
        name = vars(self).get("model") or vars(self).get("path")  # attributes, never a property that loads a model
        return geometry_of_dir(name) if isinstance(name, str) and name else None

    def generates_with(self, model) -> bool:
        """Whether this policy generates with ``model``'s parameters themselves (an in-process backend given
        the trained model): then a trainer has no weights to push to it."""
        return False

    async def aclose(self) -> None:
        return None


class ServeClock:
    """When one model call started being served (left its backend's queue): :attr:`started` is a
    ``time.monotonic()`` reading, None while the call waits. ``on_start`` runs once, in the thread that marks it
    (the local batcher's), so it must be thread-safe; the graph passes LangGraph's node heartbeat there, so a
    node's timeout counts from the moment its model call is served, not from when it was queued."""

    __slots__ = ("_on_start", "started")

    def __init__(self, on_start: Callable[[], None] | None = None):
        self.started: float | None = None
        self._on_start = on_start

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()
            if self._on_start is not None:
                self._on_start()


#: the clock of the model call being made in this context (set by the graph around ``Policy.generate``)
SERVE_CLOCK: contextvars.ContextVar[ServeClock | None] = contextvars.ContextVar("paravt_serve_clock", default=None)


def being_served() -> None:
    """Called by a backend (in the calling context) when the current request leaves its own queue."""
    clock = SERVE_CLOCK.get()
    if clock is not None:
        clock.start()


class LoopClients:
    """One client (and one concurrency semaphore) per event loop: an async HTTP client belongs to the loop it
    was made in, and an agent may be driven from several (its own loop thread, a caller's ``asyncio.run``)."""

    def __init__(self, make, concurrency: int):
        self.make, self.concurrency = make, concurrency
        self._entries: dict[int, tuple] = {}

    def get(self):
        """``(client, semaphore)`` of the running loop."""
        import asyncio

        loop = asyncio.get_running_loop()
        entry = self._entries.get(id(loop))
        if entry is None or entry[2] is not loop:  # a new loop that reuses a closed one's id gets its own
            entry = (self.make(), asyncio.Semaphore(self.concurrency), loop)
            self._entries[id(loop)] = entry
        return entry[0], entry[1]

    async def aclose(self, close) -> None:
        """``await close(client)`` for the running loop's client; forget every loop's."""
        import asyncio

        for client, _, loop in list(self._entries.values()):
            if loop is asyncio.get_running_loop():
                await close(client)
        self._entries.clear()


@functools.cache
def takes_role(cls: type) -> bool:
    """Whether ``cls.generate`` accepts the ``role`` keyword (policies written before it existed do not)."""
    params = inspect.signature(cls.generate).parameters
    return "role" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def map_images(messages: list[dict], image_part) -> list[dict]:
    """The messages with every image part replaced by ``image_part(frame)`` (text parts kept as they are)."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = [image_part(p["image"]) if p["type"] == "image" else {"type": "text", "text": p["text"]}
                       for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def text_of(content) -> str:
    """The text parts of a message's content."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")


def images_of(messages: list[dict]) -> list[np.ndarray]:
    """The frames of a conversation, in order."""
    return [p["image"] for m in messages if not isinstance(m["content"], str) for p in m["content"]
            if p["type"] == "image"]


class _EncodedFrames:
    """Base64 frames by content (a digest of the pixels), LRU, bounded by bytes. A planner's overview goes
    out with every planner turn and a question's G rollouts share it: encoded once, sent as the same
    bytes each time (which is also what lets a server's prefix cache match them)."""

    def __init__(self, max_bytes: int = 64 << 20):
        import threading
        from collections import OrderedDict

        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, image: np.ndarray, fmt: str) -> str:
        import hashlib

        arr = np.ascontiguousarray(image, dtype=np.uint8)
        key = (hashlib.blake2b(arr.data, digest_size=16).digest(), arr.shape, fmt.upper())
        with self._lock:
            text = self._items.get(key)
            if text is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return text
        text = _encode(arr, fmt)
        with self._lock:
            self.misses += 1
            if key not in self._items:
                self._items[key] = text
                self.bytes += len(text)
                while self.bytes > self.max_bytes and self._items:
                    _, gone = self._items.popitem(last=False)
                    self.bytes -= len(gone)
        return text


def _encode(image: np.ndarray, fmt: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")


ENCODED = _EncodedFrames()


def encode_image(image: np.ndarray, fmt: str = "PNG") -> str:
    """Base64 of an RGB frame (PNG by default: lossless, so every backend sees the same pixels); a frame
    already encoded is not encoded again (:data:`ENCODED`)."""
    return ENCODED.get(image, fmt)
