"""Frames by content key: what lets the agent graph's state stay plain data.

The graph's messages never hold pixels. An image part is ``{"type": "image", "ref": key, "timestamp": t}``
where ``key`` is a digest of the frame's pixels and shape (:func:`frame_key`); a :class:`FrameStore` in the
run's context holds the frames and turns references back into arrays at the policy's door
(:meth:`FrameStore.materialize`). So a checkpointer can save the state as it is, and a resumed run finds its
frames again by key: in memory, in the store's directory (a durable run's), or by decoding the overview again
(the same video and frame count give the same pixels, hence the same keys).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from paravt_agent.errors import ParaVTError

__all__ = ["FrameStore", "MissingFrame", "frame_key"]


class MissingFrame(ParaVTError):
    """A frame reference whose pixels this process does not have (a resumed run without its frame directory)."""


def frame_key(frame: np.ndarray) -> str:
    """A frame's content key: blake2b of its uint8 pixels, salted with its shape (hex, 32 characters)."""
    arr = np.ascontiguousarray(frame, dtype=np.uint8)
    shape = "x".join(map(str, arr.shape)).encode()[:16]
    return hashlib.blake2b(arr.data, digest_size=16, person=shape).hexdigest()


class FrameStore:
    """Frames by :func:`frame_key`: an LRU in memory bounded by ``max_bytes`` and, with ``directory``, a
    write-once copy on disk (``<key>.npy``) that outlives the process. Thread-safe; one store may serve many
    runs (keys are content, so runs share frames they have in common)."""

    def __init__(self, directory: str | os.PathLike | None = None, max_bytes: int = 1 << 30):
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.bytes = max_bytes, 0
        self._frames: OrderedDict[str, np.ndarray] = OrderedDict()
        self._by_id: dict[int, tuple[np.ndarray, str]] = {}  # id(array) -> (array, key): no re-hash of a known array
        self._lock = threading.Lock()

    def put(self, frame: np.ndarray) -> str:
        """Keep ``frame`` and return its key (the same array object is hashed once)."""
        known = self._by_id.get(id(frame))
        key = known[1] if known is not None and known[0] is frame else frame_key(frame)
        with self._lock:
            if key not in self._frames:
                self._frames[key] = frame
                self.bytes += frame.nbytes
                self._by_id[id(frame)] = (frame, key)
                self._evict()
            else:
                self._frames.move_to_end(key)
        if self.directory is not None:
            path = self.directory / f"{key}.npy"
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, np.ascontiguousarray(frame, dtype=np.uint8))
                os.replace(tmp, path)  # whole or absent: a crash never leaves half a frame under its key
        return key

    def get(self, key: str) -> np.ndarray:
        with self._lock:
            frame = self._frames.get(key)
            if frame is not None:
                self._frames.move_to_end(key)
                return frame
        path = self.directory / f"{key}.npy" if self.directory is not None else None
        if path is None or not path.exists():
            raise MissingFrame(f"frame {key} is not in this process's frame store"
                               + ("" if self.directory is None else f" nor in {self.directory}")
                               + "; a run resumed in another process needs the frame directory it ran with")
        frame = np.load(path)
        with self._lock:
            self._frames[key] = frame
            self.bytes += frame.nbytes
            self._by_id[id(frame)] = (frame, key)
            self._evict()
        return frame

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._frames:
                return True
        return self.directory is not None and (self.directory / f"{key}.npy").exists()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and len(self._frames) > 1:
            _, gone = self._frames.popitem(last=False)
            self.bytes -= gone.nbytes
            self._by_id.pop(id(gone), None)

    def to_refs(self, messages: list[dict]) -> list[dict]:
        """``messages`` with every image part's pixels replaced by their key (kept in this store)."""
        return [_map_parts(m, lambda p: {k: v for k, v in p.items() if k != "image"} | {"ref": self.put(p["image"])}
                           if "image" in p else p) for m in messages]

    def materialize(self, messages: list[dict]) -> list[dict]:
        """``messages`` with every image reference replaced by its pixels (what a policy takes)."""
        return [_map_parts(m, lambda p: {k: v for k, v in p.items() if k != "ref"} | {"image": self.get(p["ref"])}
                           if "ref" in p else p) for m in messages]

    def frames(self, refs: list[str]) -> list[np.ndarray]:
        return [self.get(k) for k in refs]


def refs_of(messages: list[dict]) -> list[str]:
    """The frame keys of ``messages``' image parts, in order."""
    return [p["ref"] for m in messages if not isinstance(m["content"], str) for p in m["content"]
            if p.get("type") == "image" and "ref" in p]


def _map_parts(message: dict, fn) -> dict:
    content = message["content"]
    if isinstance(content, str):
        return message
    return {**message, "content": [fn(p) if p.get("type") == "image" else p for p in content]}
