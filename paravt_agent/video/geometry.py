"""The frame geometry of a model: the size a frame reaches the model at, and how the model writes a box.

A Qwen-VL model cuts an image into ``patch`` x ``patch`` pixel patches and merges ``merge`` x ``merge`` of them
into one visual token, so a frame side is a multiple of the **unit** ``patch * merge`` (Qwen3-VL 16 x 2 = 32;
Qwen2.5-VL and Qwen2-VL 14 x 2 = 28). Its image processor resizes every image by one rule (transformers'
``smart_resize``, :func:`processor_size`): sides rounded to the unit, the area kept inside
``[min_pixels, max_pixels]``. :class:`FrameGeometry` holds those numbers as the model's own processor states them
(read by :mod:`paravt_agent.policy.families` from a processor, a model directory or a served model: never assumed).

The frame protocol keeps frames at the size it gives them (:meth:`FrameConfig.bound_to`: sides multiples of the
model's unit, area at most the model's ``max_pixels``), and every path that turns a frame into visual tokens is told
the same processor sizes, :attr:`FrameGeometry.processor_size` (``min_pixels`` one unit, so a small frame is never
upscaled; ``max_pixels`` the model's): the local backend, the trainer's collate and SFT at call time, and an SGLang
server through ``--mm-process-config`` (``paravt serve``). So the reader, the tools, the trainer and the server see
the same pixels and count the same visual tokens, for any aspect ratio; a frame smaller than one unit is read at one
unit a side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paravt_agent.errors import ConfigError

__all__ = ["BOX_CONVENTIONS", "FrameGeometry", "processor_size"]

#: how a model family writes a grounding box's ``bbox_2d``: 0-1000 relative to the image's sides, or pixels of the
#: (resized) image it was shown
BOX_CONVENTIONS = ("relative-1000", "pixels")


def processor_size(height: int, width: int, unit: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` a Qwen-VL image processor resizes an image to (transformers' ``smart_resize``, which
    SGLang's servers run too): sides rounded to multiples of ``unit``; an area over ``max_pixels`` scaled down, one
    under ``min_pixels`` scaled up (aspect ratio kept as closely as the unit allows)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {width}x{height} is empty")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over the processors' 200")
    h = round(height / unit) * unit
    w = round(width / unit) * unit
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(unit, math.floor(height / beta / unit) * unit)
        w = max(unit, math.floor(width / beta / unit) * unit)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / unit) * unit
        w = math.ceil(width * beta / unit) * unit
    return h, w


@dataclass(frozen=True)
class FrameGeometry:
    """A model's frame geometry as its own processor states it: ``family`` (the config's ``model_type``),
    ``patch`` and ``merge`` (the unit is their product), the ``min_pixels`` / ``max_pixels`` its processor keeps an
    image between, ``boxes`` (:data:`BOX_CONVENTIONS`) and ``source`` (where it was read: a processor, a model
    directory, a server)."""

    family: str | None
    patch: int
    merge: int
    min_pixels: int
    max_pixels: int
    boxes: str = "pixels"
    source: str = ""

    @property
    def unit(self) -> int:
        """A frame side is a multiple of this many pixels (one merged visual token is ``unit`` x ``unit``)."""
        return self.patch * self.merge

    @property
    def processor_size(self) -> dict:
        """The ``size`` every path passes its image processor (call time, or SGLang's ``--mm-process-config``):
        ``min_pixels`` one unit (a protocol frame is never upscaled), ``max_pixels`` the model's."""
        return {"shortest_edge": self.unit * self.unit, "longest_edge": self.max_pixels}

    def seen(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` the model sees an image of this size at (its processor, told
        :attr:`processor_size`): the image itself for a frame the protocol sized."""
        return processor_size(height, width, self.unit, self.unit * self.unit, self.max_pixels)

    def tokens(self, height: int, width: int) -> int:
        """Visual tokens of an image of this size (without its two vision markers)."""
        h, w = self.seen(height, width)
        return (h // self.unit) * (w // self.unit)

    def describe(self) -> str:
        """``qwen2_5_vl (model dir X): 28-pixel unit (patch 14 x merge 2), 3136-12845056 pixels, pixel boxes``."""
        where = f" ({self.source})" if self.source else ""
        boxes = "0-1000 boxes" if self.boxes == "relative-1000" else "pixel boxes"
        return (f"{self.family or 'unknown family'}{where}: {self.unit}-pixel unit (patch {self.patch} x merge "
                f"{self.merge}), {self.min_pixels}-{self.max_pixels} pixels, {boxes}")

    def check_factor(self, factor: int | None, setting: str = "frames.factor") -> None:
        """Refuse (:class:`ConfigError`) a stated frame factor that contradicts this model's unit."""
        if factor is not None and factor != self.unit:
            raise ConfigError(
                f"{setting}: {factor} contradicts the model, whose frames are multiples of {self.unit} pixels "
                f"({self.describe()}): frames of {factor}-pixel sides would be resized again by its processor, and "
                f"a server would count other visual tokens than this client. Delete {setting} from the agent config "
                f"(or from the agent_config.yaml of the model directory it came from: the frame unit is read from the "
                f"model), or use a model of the family it was written for")
