"""Video I/O: the frame protocol of the paper, on top of interchangeable decoders.

* :mod:`~paravt_agent.video.sampling` — :class:`FrameConfig` (the one settings
  object of the protocol) and the pure rules: which times an overview or a crop
  samples, frame sizes, the window rule, file identity.
* :mod:`~paravt_agent.video.decoders` — PyAV (default), decord, torchcodec.
* :mod:`~paravt_agent.video.reader` — :class:`VideoReader` and the decoder pool.
"""

from paravt_agent.errors import VideoError
from paravt_agent.video.decoders import DECODERS, Decoder, available_backends
from paravt_agent.video.reader import POOL, DecoderPool, VideoReader, open_video
from paravt_agent.video.sampling import (
    BACKENDS,
    Clip,
    FrameConfig,
    VideoInfo,
    check_window,
    crop_times,
    file_identity,
    fit_size,
    overview_times,
)

__all__ = [
    "BACKENDS",
    "DECODERS",
    "POOL",
    "Clip",
    "Decoder",
    "DecoderPool",
    "FrameConfig",
    "VideoError",
    "VideoInfo",
    "VideoReader",
    "available_backends",
    "check_window",
    "crop_times",
    "file_identity",
    "fit_size",
    "open_video",
    "overview_times",
]
