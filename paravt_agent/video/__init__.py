"""Video I/O: the frame protocol of the paper, on top of interchangeable decoders.

* :mod:`~paravt_agent.video.sampling` — :class:`FrameConfig` (the one settings
  object of the protocol) and the pure rules: which times an overview or a crop
  samples, frame sizes, the window rule, file identity.
* :mod:`~paravt_agent.video.geometry` — :class:`FrameGeometry`: a model's frame unit, pixel bounds and box
  convention, and the size rule its processor applies.
* :mod:`~paravt_agent.video.decoders` — PyAV (default), decord, torchcodec.
* :mod:`~paravt_agent.video.reader` — :class:`VideoReader` and the decoder pool.
"""

from paravt_agent.errors import VideoError
from paravt_agent.video.decoders import DECODERS, Decoder, available_backends
from paravt_agent.video.geometry import FrameGeometry, processor_size
from paravt_agent.video.reader import POOL, DecoderPool, VideoReader, open_video
from paravt_agent.video.sampling import *  # noqa: F403 (the protocol's names, listed in __all__ below)
from paravt_agent.video.sampling import __all__ as _sampling

__all__ = ["DECODERS", "POOL", "Decoder", "DecoderPool", "FrameGeometry", "VideoError", "VideoReader",
           "available_backends", "open_video", "processor_size", *_sampling]
