"""The one interface every model backend implements (ARCHITECTURE.md, decision 3)."""

from __future__ import annotations

import base64
import io
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field

__all__ = [
    "Generation",
    "Policy",
    "Sampling",
    "continuation_text",
    "continued_ids",
    "encode_image",
    "last_token_turn",
    "map_images",
    "text_of",
]


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


# --------------------------------------------------------------------------- continuing from token ids
#
# A planner turn after the first is the previous turn's exact tokens (prompt, forced prefix, sampled
# output) followed by the new messages rendered by the chat template. The graph puts the Generation on
# the assistant message it produced ({"role": "assistant", "content": text, "generation": gen}); token
# backends continue from it instead of re-tokenising the model's text, so what the trainer scores is
# exactly what was sampled.


def last_token_turn(messages: list[dict]) -> tuple[int | None, Generation | None]:
    """Index and Generation of the last assistant message that carries token ids, or ``(None, None)``."""
    for k in range(len(messages) - 1, -1, -1):
        m = messages[k]
        gen = m.get("generation") if m["role"] == "assistant" else None
        if gen is not None and gen.prompt_ids is not None and gen.output_ids is not None:
            return k, gen
    return None, None


def continued_ids(gen: Generation, eos_id: int) -> list[int]:
    """The whole token sequence of a finished turn: prompt + forced prefix + sampled output (+ end of turn).

    A turn cut by the token limit gets the end-of-turn token appended (not sampled: never trained).
    """
    ids = [*gen.prompt_ids, *(gen.prefix_ids or []), *gen.output_ids]
    if not gen.output_ids or gen.output_ids[-1] != eos_id:
        ids.append(eos_id)
    return ids


def continuation_text(render, messages: list[dict], k: int, end_token: str = "<|im_end|>") -> str | None:
    """The text that follows the end-of-turn token of assistant message ``k``, up to the generation prompt.

    ``render(messages, add_generation_prompt)`` is the chat template. Returns None when the template
    is not prefix-stable (it re-renders earlier turns differently once later messages exist), in which
    case the caller must fall back to a full render.
    """
    full = render(messages, True)
    prev = render(messages[: k + 1], False)
    cut = prev.rfind(end_token)
    if not full.startswith(prev) or cut < 0:
        return None
    return prev[cut + len(end_token):] + full[len(prev):]
