"""The one interface every model backend implements (ARCHITECTURE.md, decision 3)."""

from __future__ import annotations

import base64
import io
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field

__all__ = ["Generation", "Policy", "Sampling", "encode_image", "map_images", "text_of"]


class Sampling(BaseModel):
    """Decoding settings. ``temperature=0`` is greedy."""

    temperature: float = Field(0.0, ge=0, description="0 = greedy; the paper samples RL rollouts at 0.7.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off.")
    max_new_tokens: int = Field(1024, ge=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


@dataclass
class Generation:
    """What a policy returns. ``text`` is the whole response, forced prefix included.

    Token-level fields are filled where the backend can: ``prefix_ids`` are the
    forced prefix's tokens (not sampled, never trained), ``output_ids`` the sampled
    tokens with their ``logprobs`` (log-probabilities under the sampling
    temperature), ``prompt_ids`` the exact prompt the model saw.
    """

    text: str
    prefix: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency: float = 0.0
    prompt_ids: list[int] | None = None
    prefix_ids: list[int] | None = None
    output_ids: list[int] | None = None
    logprobs: list[float] | None = None
    extra: dict = field(default_factory=dict)


class Policy(ABC):
    """``await policy.generate(messages, sampling, prefix="<think>\\n") -> Generation``.

    Implementations must be safe to call concurrently from one event loop.
    """

    name: str = "policy"

    @abstractmethod
    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> Generation: ...

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


def encode_image(image: np.ndarray, fmt: str = "PNG") -> str:
    """Base64 of an RGB frame (PNG by default: lossless, so every backend sees the same pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")
