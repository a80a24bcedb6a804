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
import io
from abc import ABC, abstractmethod

import numpy as np

from paravt_agent.types import Continuation, Generation, Sampling

__all__ = ["Continuation", "Generation", "Policy", "Sampling", "encode_image", "images_of", "map_images", "text_of"]


class Policy(ABC):
    """The model behind the graph. Implementations must be safe to call concurrently from one event loop.

    ``prefix`` is forced as the start of the response (the paper's think prefix); a backend that cannot
    force it must raise :class:`~paravt_agent.errors.PolicyError` rather than ignore it.
    ``continuation`` (a token backend's business) says which earlier assistant turn the conversation
    continues token for token.
    """

    name: str = "policy"
    #: whether ``generate`` returns token ids and logprobs (what RL training needs)
    returns_tokens: bool = False

    @property
    def supports_prefix(self) -> bool:
        """Whether this backend can force a response prefix (the think prefix)."""
        return True

    @abstractmethod
    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None) -> Generation: ...

    def count_tokens(self, messages: list[dict]) -> int | None:
        """Prompt length in tokens, where the backend can tell without generating."""
        return None

    async def aclose(self) -> None:
        return None


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


def encode_image(image: np.ndarray, fmt: str = "PNG") -> str:
    """Base64 of an RGB frame (PNG by default: lossless, so every backend sees the same pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")
