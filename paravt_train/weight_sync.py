"""Weight sync from the trainer to an SGLang rollout server, with SGLang's documented HTTP API.

* :class:`SGLangWeightSync` (``weight_sync: disk``): rank 0 writes a plain model
  directory; the server reloads it with ``/update_weights_from_disk``. Works
  whenever the server can read the directory (same machine or shared storage).
* :class:`SGLangTensorSync` (``weight_sync: tensor``): the tensors themselves go to
  ``/update_weights_from_tensor`` as SGLang's serialised named tensors (a
  ``ForkingPickler`` payload, base64, one copy per tensor-parallel rank), in
  buckets. Pickled tensors travel as shared-memory / CUDA IPC handles, so this
  path needs the server on the same machine (co-located rollouts); nothing is
  written to disk.

Both pause generation around the swap (``/pause_generation`` →
update → ``/continue_generation``, which runs even when the update fails).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["SGLangTensorSync", "SGLangWeightSync", "serialize_named_tensors"]


def _base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class SGLangWeightSync:
    """Pushes weights to an SGLang server with its documented HTTP API:

    ``POST /pause_generation {"mode": "in_place"}`` → ``POST /update_weights_from_disk
    {"model_path": DIR}`` (answer ``{"success", "message", ...}``) → ``POST /continue_generation``.
    The directory must be readable by the server (same machine or a shared filesystem).
    """

    def __init__(self, endpoint: str, folder: Path, timeout: float = 600.0):
        self.url = _base_url(endpoint)
        self.folder = Path(folder)
        self.timeout = timeout

    def push(self, model_dir: Path) -> dict:
        import httpx

        from paravt_agent.errors import PolicyError

        with httpx.Client(timeout=self.timeout) as client:
            try:
                client.post(f"{self.url}/pause_generation", json={"mode": "in_place"}).raise_for_status()
                try:
                    resp = client.post(f"{self.url}/update_weights_from_disk",
                                       json={"model_path": str(Path(model_dir).resolve())})
                finally:
                    client.post(f"{self.url}/continue_generation", json={}).raise_for_status()
            except httpx.HTTPError as exc:
                raise PolicyError(f"weight sync to {self.url} failed: {exc}", transient=True) from exc
        data = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code != 200 or not data.get("success", False):
            raise PolicyError(f"{self.url}/update_weights_from_disk refused {model_dir}: "
                              f"{data.get('message') or resp.text[:300]}")
        return data


def serialize_named_tensors(named_tensors: list[tuple[str, object]]) -> str:
    """SGLang's wire format for ``/update_weights_from_tensor``: a ``ForkingPickler`` pickle (tensors as
    shared-memory / CUDA IPC handles), base64. SGLang's own serializer is used when it is installed."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        import base64
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(named_tensors)
        return base64.b64encode(buf.getvalue()).decode("ascii")
    return MultiprocessingSerializer.serialize(named_tensors, output_str=True)


class SGLangTensorSync:
    """Pushes tensors to a co-located SGLang server: ``POST /update_weights_from_tensor
    {"serialized_named_tensors": [payload] * tp_size, "flush_cache": last bucket}`` per bucket of about
    ``bucket_bytes``, generation paused around the whole update. Parameter names are the Hugging Face
    checkpoint names (what SGLang's ``load_weights`` maps)."""

    def __init__(self, endpoint: str, tp_size: int = 1, bucket_bytes: int = 512 << 20, timeout: float = 600.0):
        self.url = _base_url(endpoint)
        self.tp_size = tp_size
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout

    def buckets(self, named_tensors: Iterable[tuple[str, object]]):
        bucket, size = [], 0
        for name, t in named_tensors:
            bucket.append((name, t.detach().contiguous()))
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def push(self, named_tensors: Iterable[tuple[str, object]]) -> dict:
        import httpx

        from paravt_agent.errors import PolicyError

        buckets = list(self.buckets(named_tensors))
        sent = 0
        with httpx.Client(timeout=self.timeout) as client:
            try:
                client.post(f"{self.url}/pause_generation", json={"mode": "in_place"}).raise_for_status()
                try:
                    for i, bucket in enumerate(buckets):
                        payload = serialize_named_tensors(bucket)
                        resp = client.post(f"{self.url}/update_weights_from_tensor", json={
                            "serialized_named_tensors": [payload] * self.tp_size,
                            "flush_cache": i == len(buckets) - 1})
                        data = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
                        if resp.status_code != 200 or not data.get("success", False):
                            raise PolicyError(f"{self.url}/update_weights_from_tensor refused bucket {i + 1}/"
                                              f"{len(buckets)}: {data.get('message') or resp.text[:300]}")
                        sent += len(bucket)
                finally:
                    client.post(f"{self.url}/continue_generation", json={}).raise_for_status()
            except httpx.HTTPError as exc:
                raise PolicyError(f"weight sync to {self.url} failed: {exc}", transient=True) from exc
        return {"success": True, "tensors": sent, "buckets": len(buckets)}
