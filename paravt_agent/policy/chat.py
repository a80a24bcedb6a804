"""Client-side tokenisation shared by the token backends (``local`` and ``sglang``).

Neutral messages → the model's own chat template and processor → token ids, with

* **continuation from exact ids**: a planner turn after the first is the previous
  turn's exact tokens (prompt, forced prefix, sampled output, end of turn) followed
  by the tokens of the messages after it (:class:`~paravt_agent.types.Continuation`),
  so model output is never decoded and re-encoded;
* **the protocol's frame sizes kept**: the processor is told the sizes of the model's frame geometry
  (:attr:`~paravt_agent.video.FrameGeometry.processor_size`: min one unit, max the model's), so a frame the video
  module sized with the model's unit is never resized (Qwen3-VL's default ``min_pixels`` of 65536 would upscale
  every 224x224 protocol frame to 256x256, a third more visual tokens), and any other image is resized exactly as
  an SGLang server told the same sizes (``paravt serve``) resizes it;
* **expanded and compact ids**: ``prompt_ids`` hold one placeholder per visual
  token (what the model's forward pass consumes); :meth:`ChatTokenizer.compact`
  gives the one-placeholder-per-image form a server like SGLang expands itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from paravt_agent.policy.base import images_of, map_images
from paravt_agent.policy.families import check_vision_inputs, geometry_of_processor
from paravt_agent.types import Continuation, Generation

__all__ = ["BANNED_LOGIT", "ChatTokenizer", "EncodedPrompt", "ban", "continuation_text", "continued_ids",
           "file_token_count", "to_chat_messages"]

END_OF_TURN = "<|im_end|>"
#: the logit of a token no policy may sample (a vision placeholder), everywhere a distribution is sampled or
#: scored: the local sampler, SGLang's ``logit_bias`` and the trainer's log-probabilities. Far below any real
#: logit (its probability is exactly 0 in float32), yet finite: an entropy over -inf logits is NaN.
BANNED_LOGIT = -1e4


def ban(logits, ids):
    """``logits`` (..., V) with the tokens ``ids`` set to :data:`BANNED_LOGIT` (out of place, differentiable);
    ``logits`` itself when there are none. The behaviour policy is the model with these tokens banned, so the
    sampler and every log-probability that scores its samples apply the same ban, before the temperature (where
    SGLang adds its ``logit_bias``: at any τ the banned tokens stay far below the others)."""
    import torch

    if ids is None or len(ids) == 0:
        return logits
    idx = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    return logits.index_fill(-1, idx.to(logits.device), BANNED_LOGIT)


def to_chat_messages(messages: list[dict]) -> tuple[list[dict], list]:
    """Neutral messages -> (chat-template messages, PIL images in order)."""
    from PIL import Image

    images = []

    def part(img):
        images.append(img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img, np.uint8)))
        return {"type": "image"}

    return map_images(messages, part), images


def continued_ids(gen: Generation, eos_id: int) -> list[int]:
    """The whole token sequence of a finished turn: prompt + forced prefix + sampled output (+ end of turn).

    A turn cut by the token limit gets the end-of-turn token appended (not sampled: never trained).
    """
    ids = [*gen.prompt_ids, *(gen.prefix_ids or []), *gen.output_ids]
    if not gen.output_ids or gen.output_ids[-1] != eos_id:
        ids.append(eos_id)
    return ids


def continuation_text(render, chat: list[dict], k: int, end_token: str = END_OF_TURN) -> str | None:
    """The text that follows the end-of-turn token of assistant message ``k``, up to the generation prompt.

    ``render(messages, add_generation_prompt)`` is the chat template. Returns None when the template
    is not prefix-stable (it re-renders earlier turns differently once later messages exist), in which
    case the caller must fall back to a full render.
    """
    full = render(chat, True)
    prev = render(chat[: k + 1], False)
    cut = prev.rfind(end_token)
    if not full.startswith(prev) or cut < 0:
        return None
    return prev[cut + len(end_token):] + full[len(prev):]


@dataclass
class EncodedPrompt:
    """A tokenised prompt: ``ids`` (expanded placeholders, the forced prefix at the end), the prefix's
    ids, the prompt's frames with their pixel values and patch grids, and whether the earlier turns had
    to be re-rendered instead of continued from their ids."""

    ids: list[int]
    prefix_ids: list[int]
    images: list[np.ndarray]
    image_grid_thw: list[tuple[int, int, int]]
    pixel_values: object | None = None  # torch.Tensor
    retokenized: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids[: len(self.ids) - len(self.prefix_ids)]


class ChatTokenizer:
    """A Hugging Face processor (tokenizer + chat template + image processor) used on the client; ``family``: the
    model's ``model_type`` (its box convention in :attr:`geometry`)."""

    def __init__(self, processor, family: str | None = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        from collections import OrderedDict

        self._lock = threading.RLock()  # one encoding at a time: the memo and the fast tokenizer are not thread-safe
        self._memo: OrderedDict = OrderedDict()  # image_inputs by frame bytes
        self._memo_size = 0
        self.memo_bytes = 64 << 20
        self.remember = True  # False: every call runs the image processor (LocalPolicy(reuse=False))
        self.eos_id = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(processor.image_token)
        # the vision placeholders: a model that samples one would make its own turn unreadable (and unscorable)
        names = [getattr(processor, a, None) for a in ("image_token", "video_token", "vision_start_token",
                                                         "vision_end_token")]
        names += ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"]
        unk = self.tokenizer.unk_token_id
        self.placeholder_ids = sorted({i for i in (self.tokenizer.convert_tokens_to_ids(n) for n in names if n)
                                       if isinstance(i, int) and i >= 0 and i != unk})
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id
        self.uses_mm_token_types = "mm_token_type_ids" in getattr(processor, "model_input_names", [])
        #: the model's frame geometry, as its processor states it (the unit, the pixel bounds)
        self.geometry = geometry_of_processor(processor, family)
        self.merge = self.geometry.merge
        self.unit = self.geometry.unit  # a frame side is a multiple of this

    # ------------------------------------------------------------------ text

    def render(self, chat: list[dict], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)

    def tokens(self, text: str) -> list[int]:
        if not text:
            return []
        with self._lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ images

    def size_kwargs(self, images) -> dict:
        """Processor options that keep frames at the size the frame protocol gave them (the geometry's
        :attr:`~paravt_agent.video.FrameGeometry.processor_size`: no upscaling to the processor's own
        ``min_pixels``, the model's ``max_pixels``): the same sizes ``paravt serve`` gives an SGLang server, so a
        frame of any size gets the same visual tokens here and there."""
        return {"size": dict(self.geometry.processor_size)} if images else {}

    def image_inputs(self, images: list) -> dict:
        """``pixel_values`` and ``image_grid_thw`` of frames, as a training forward pass needs them.

        Remembered for the last few frame lists (by their bytes, bounded by :attr:`memo_bytes`): the G
        rollouts of a prompt and a planner's later turns carry the same frames again."""
        if not images:
            return {}
        if not self.remember:
            out = self.processor.image_processor(images=list(images), return_tensors="pt",
                                                 **self.size_kwargs(images))
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        import hashlib

        h = hashlib.blake2b(digest_size=16)
        for img in images:
            a = np.asarray(img)
            h.update(repr(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        key = h.digest()
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return dict(hit)
        out = self.processor.image_processor(images=list(images), return_tensors="pt", **self.size_kwargs(images))
        res = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        size = res["pixel_values"].numel() * res["pixel_values"].element_size()
        with self._lock:
            if size <= self.memo_bytes and key not in self._memo:
                self._memo[key] = res
                self._memo_size += size
                while self._memo_size > self.memo_bytes:
                    _, old = self._memo.popitem(last=False)
                    self._memo_size -= old["pixel_values"].numel() * old["pixel_values"].element_size()
        return dict(res)

    def visual_tokens(self, grid) -> int:
        t, h, w = (int(x) for x in grid)
        return t * h * w // (self.merge * self.merge)

    # ------------------------------------------------------------------ prompts

    def encode(self, messages: list[dict], prefix: str = "", continuation: Continuation | None = None,
               pixels: bool = True) -> EncodedPrompt:
        """``messages`` + generation prompt (+ ``prefix`` as tokens), continuing ``continuation``'s exact
        ids when given (falling back to a full render when the template is not prefix-stable). Thread-safe
        (one encoding at a time)."""
        with self._lock:
            return self._encode(messages, prefix, continuation, pixels)

    def _encode(self, messages: list[dict], prefix: str, continuation: Continuation | None,
                pixels: bool) -> EncodedPrompt:
        chat, pil = to_chat_messages(messages)
        frames = images_of(messages)
        tail, k = None, None
        prev = continuation.generation if continuation is not None else None
        if prev is not None and prev.prompt_ids is not None and prev.output_ids is not None:
            k = continuation.message_index
            tail = continuation_text(self.render, chat, k)
        if tail is None:
            # the frames through the (remembered) image processor; each image's one placeholder in the
            # rendered text expanded to its visual tokens, as the processor does
            img = self.image_inputs(pil)
            ids = self.tokens(self.render(chat, True))
            pixel_list = [img["pixel_values"]] if img else []
            grid_list = [img["image_grid_thw"]] if img else []
            if img:
                ids = self.expand(ids, img["image_grid_thw"].tolist())
        else:
            before = len(images_of(messages[: k + 1]))
            pixel_list, grid_list = [], []
            if before:
                old = self.image_inputs(pil[:before])
                pixel_list.append(old["pixel_values"])
                grid_list.append(old["image_grid_thw"])
            new = pil[before:]
            enc = self.processor(text=[tail], images=new or None, return_tensors="pt", **self.size_kwargs(new))
            ids = continued_ids(prev, self.eos_id) + enc["input_ids"][0].tolist()
            if enc.get("pixel_values") is not None:
                pixel_list.append(enc["pixel_values"])
                grid_list.append(enc["image_grid_thw"])
        import torch

        grids = torch.cat(grid_list) if grid_list else None
        prefix_ids = self.tokens(prefix)
        return EncodedPrompt(
            ids=ids + prefix_ids, prefix_ids=prefix_ids, images=frames,
            image_grid_thw=[tuple(int(x) for x in g) for g in grids] if grids is not None else [],
            pixel_values=torch.cat(pixel_list) if (pixels and pixel_list) else None,
            retokenized=prev is not None and tail is None,
        )

    def mm_token_types(self, input_ids):
        """The Qwen VL families' ``mm_token_type_ids``: 1 on image placeholder tokens, 0 elsewhere."""
        return (input_ids == self.image_token_id).long()

    def check_inputs(self, inputs: dict, where: str) -> None:
        """Refuse model inputs whose images lack their ``mm_token_type_ids`` or whose marks do not cover exactly
        their visual tokens (:func:`~paravt_agent.policy.families.check_vision_inputs`)."""
        check_vision_inputs(inputs, self.image_token_id, self.merge, where)

    # ------------------------------------------------------------------ placeholder forms

    def compact(self, ids: list[int]) -> list[int]:
        """One image placeholder per image: each run of placeholders collapsed to one (the form a server
        that runs its own image processor, like SGLang, expects)."""
        out: list[int] = []
        for t in ids:
            if t == self.image_token_id and out and out[-1] == self.image_token_id:
                continue
            out.append(t)
        return out

    def expand(self, ids: list[int], grids) -> list[int]:
        """The inverse of :meth:`compact`: the i-th placeholder repeated for image i's visual tokens."""
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                if k >= len(grids):
                    raise ValueError("more image placeholders than images")
                out.extend([t] * self.visual_tokens(grids[k]))
                k += 1
            else:
                out.append(t)
        if k != len(grids):
            raise ValueError(f"{len(grids)} images but {k} placeholders")
        return out

    def round_trip(self, compact_ids: list[int]) -> list[int]:
        """What a server that decodes ``input_ids`` to text and tokenises that text again (SGLang does for
        multimodal requests) ends up with, in compact form."""
        text = self.tokenizer.decode(compact_ids, skip_special_tokens=False)
        return self.tokens(text)


_FILE_TOKENIZERS: dict[str, object] = {}
_FILE_LOCK = threading.Lock()


def file_token_count(model_dir: str, text: str) -> int | None:
    """Tokens of ``text`` by the model directory's ``tokenizer.json`` alone (the `tokenizers` library: no torch, no
    weights, no processor), as the model's tokenizer counts them without special tokens; None when the directory has
    no such file. Input checks use it before any model loads (a question over its limit is refused at once)."""
    import os

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with _FILE_LOCK:
        if path not in _FILE_TOKENIZERS:
            from tokenizers import Tokenizer  # Rust, light: no transformers, no torch

            _FILE_TOKENIZERS[path] = Tokenizer.from_file(path)
        tok = _FILE_TOKENIZERS[path]
    return len(tok.encode(text, add_special_tokens=False).ids) if text else 0
