"""Work the ``local`` backend does once per distinct input instead of once per request.

* :class:`VisionCache`: the vision tower's output per distinct image (keyed by the
  image's pixel bytes and patch grid), bounded by bytes. The G rollouts of a prompt
  carry the same overview frames G times, the planner's second turn carries them
  again: each distinct frame goes through the tower once, and the features reach
  ``generate`` through ``transformers``' ``mm_encoder_outputs`` argument.
* :class:`PrefixCache`: the KV cache of finished sequences (prompt + generated
  tokens), bounded by bytes. A request whose token ids (and frames) continue a stored
  sequence (the planner's answer turn after its tool turn) prefills only the new
  tokens. Rows of one batch with identical prompts (the G rollouts) prefill once and
  share the copy.

Both caches are keyed by the model's weights version (the in-place version counters
of its parameters), so an optimizer step or a weight load in the in-process trainer
empties them instead of serving stale features.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["PrefixCache", "VisionCache", "feature_slice", "image_keys", "weights_version"]


def weights_version(module) -> tuple:
    """Changes whenever any parameter of ``module`` is modified in place (optimizer steps, ``load_state_dict``)."""
    return (id(module), sum(p._version for p in module.parameters()))


def image_keys(pixel_values, grid: list) -> list[bytes]:
    """One key per image of a prompt: its patch grid and a digest of its pixel values."""
    import numpy as np

    keys, at = [], 0
    flat = pixel_values.detach().cpu().contiguous()
    for t, h, w in grid:
        n = int(t) * int(h) * int(w)
        block = np.ascontiguousarray(flat[at:at + n].numpy())
        keys.append(hashlib.blake2b(block.tobytes(), digest_size=16, person=f"{t}x{h}x{w}".encode()[:16]).digest())
        at += n
    return keys


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class VisionCache:
    """Vision-tower features per distinct image, least recently used first out, at most ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.version: tuple | None = None
        self.entries: OrderedDict[bytes, tuple] = OrderedDict()  # key -> (embeds, [deepstack per layer])
        self.hits = self.misses = 0

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def features(self, model, rows: list[tuple[object, list, list[bytes]]]):
        """``mm_encoder_outputs`` for ``rows`` (each ``(pixel_values, grid, keys)``) in row order, running
        the tower once on the images not cached; ``None`` when the model takes no precomputed features."""
        import torch

        base = model.model
        version = weights_version(base.visual)
        if version != self.version:
            self.clear()
            self.version = version
        todo: dict[bytes, tuple] = {}
        for pixels, grid, keys in rows:
            at = 0
            for (t, h, w), k in zip(grid, keys, strict=True):
                n = int(t) * int(h) * int(w)
                if k not in self.entries and k not in todo:
                    todo[k] = (pixels[at:at + n], (int(t), int(h), int(w)))
                at += n
        fresh: dict[bytes, tuple] = {}
        out_type = None
        if todo:
            self.misses += len(todo)
            pix = torch.cat([p for p, _ in todo.values()]).to(model.device)
            grid_t = torch.tensor([g for _, g in todo.values()], device=model.device)
            out = base.get_image_features(pix, grid_t, return_dict=True)
            out_type = type(out)
            deep = getattr(out, "deepstack_features", None)
            for i, k in enumerate(todo):
                fresh[k] = (out.pooler_output[i], [layer[i] for layer in deep] if deep is not None else None)
        embeds, deep_rows = [], []
        for _pixels, _grid, keys in rows:
            for k in keys:
                if k in fresh:
                    e = fresh[k]
                else:
                    e = self.entries[k]
                    self.entries.move_to_end(k)
                    self.hits += 1
                embeds.append(e[0])
                deep_rows.append(e[1])
        for k, e in fresh.items():  # stored after use: an entry larger than the bound is used, not kept
            size = _nbytes([e[0], *(e[1] or [])])
            if size <= self.max_bytes:
                self.entries[k] = e
                self.bytes += size
        while self.bytes > self.max_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.bytes -= _nbytes([old[0], *(old[1] or [])])
        if out_type is None:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            out_type = _deepstack_output_type(model) or BaseModelOutputWithPooling
        kw = {"pooler_output": tuple(embeds)}
        if deep_rows and deep_rows[0] is not None:
            kw["deepstack_features"] = [tuple(r[layer] for r in deep_rows) for layer in range(len(deep_rows[0]))]
        return {"image": out_type(**kw)}


def feature_slice(mm: dict, start: int, count: int) -> dict:
    """Images ``start`` .. ``start + count`` of precomputed vision features (one prompt's)."""
    out = {}
    for name, o in mm.items():
        kw = {"pooler_output": o.pooler_output[start:start + count]}
        if getattr(o, "deepstack_features", None) is not None:
            kw["deepstack_features"] = [layer[start:start + count] for layer in o.deepstack_features]
        out[name] = type(o)(**kw)
    return out


def _deepstack_output_type(model):
    import sys

    mod = sys.modules.get(type(model.model).__module__)
    return getattr(mod, "BaseModelOutputWithDeepstackFeatures", None)


@dataclass
class _Entry:
    ids: tuple[int, ...]
    images: tuple[bytes, ...]
    layers: list  # [(keys, values)] per layer, batch 1, length len(ids)
    rope_deltas: object
    nbytes: int


class PrefixCache:
    """KV caches of finished single sequences, looked up by the longest stored token-id prefix."""

    def __init__(self, max_bytes: int = 256 << 20, min_tokens: int = 32):
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter shared prefixes are not worth a lookup
        self.bytes = 0
        self.version: tuple | None = None
        self.entries: list[_Entry] = []  # most recently used last
        self.hits = self.misses = 0
        self.reused_tokens = 0

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def check_version(self, model) -> None:
        version = weights_version(model)
        if version != self.version:
            self.clear()
            self.version = version

    def put(self, ids: list[int], images: list[bytes], layers: list, rope_deltas) -> None:
        size = _nbytes([t for kv in layers for t in kv])
        if size > self.max_bytes or len(ids) < self.min_tokens:
            return
        key = tuple(ids)
        self.entries = [e for e in self.entries if e.ids != key]
        self.entries.append(_Entry(key, tuple(images), layers, rope_deltas, size))
        self.bytes = sum(e.nbytes for e in self.entries)
        while self.bytes > self.max_bytes:
            self.bytes -= self.entries.pop(0).nbytes

    def lookup(self, ids: list[int], images: list[bytes]) -> _Entry | None:
        """The stored sequence that is the longest strict prefix of ``ids`` whose frames are the first of
        ``images`` (at least one new token must remain to prefill)."""
        best = None
        for e in self.entries:
            n = len(e.ids)
            if n < len(ids) and (best is None or n > len(best.ids)) and tuple(ids[:n]) == e.ids \
                    and tuple(images[:len(e.images)]) == e.images:
                best = e
        if best is None:
            self.misses += 1
            return None
        self.entries.remove(best)
        self.entries.append(best)
        self.hits += 1
        self.reused_tokens += len(best.ids)
        return best
