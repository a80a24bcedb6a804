"""Model families: each model's frame geometry, box convention and forward inputs, read from the model itself.

The families the seed methods train, each with a tiny build in the test suite (:mod:`paravt_train.toy.families`,
docs/families.md says what was and was not tested):

==================  =====================  ===========  ==============================================================
family              ``model_type``         unit         boxes (``bbox_2d``)
==================  =====================  ===========  ==============================================================
Qwen3-VL            ``qwen3_vl``           16 x 2 = 32  0-1000, relative to the image's sides
Qwen3-VL-MoE        ``qwen3_vl_moe``       16 x 2 = 32  0-1000
Qwen2.5-VL          ``qwen2_5_vl``         14 x 2 = 28  pixels of the image as the model saw it (after its resize)
Qwen2-VL            ``qwen2_vl``           14 x 2 = 28  0-1000 (the Qwen2-VL paper's [0, 1000) normalisation)
==================  =====================  ===========  ==============================================================

The unit and pixel bounds are never taken from this table: :func:`geometry_of_processor` reads them from a loaded
processor (the local backend, the trainer, SFT), :func:`geometry_of_dir` from a model directory's files without
loading anything (``config.json`` and ``processor_config.json`` or ``preprocessor_config.json``), and
:func:`served_geometry` what an SGLang 0.5.23 server applies (its model directory, SGLang's own override for
Qwen2-VL, then its ``--mm-process-config``). :func:`serve_settings` is what ``paravt serve`` passes SGLang so that
the server keeps the frames the client sized (:attr:`~paravt_agent.video.FrameGeometry.processor_size`).

Forward inputs: every family here needs ``mm_token_type_ids`` beside the pixel values (transformers 5.24's Qwen2.5-VL
silently falls back to text-only positions without them, Qwen2-VL and Qwen3-VL raise): :func:`check_vision_inputs`
refuses a batch whose marks are missing or do not cover exactly its visual tokens, where the batch is built.
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_agent.errors import PolicyError
from paravt_agent.video.geometry import FrameGeometry

__all__ = ["FAMILIES", "box_coordinates_of", "cached_model_dir", "check_vision_inputs", "geometry_of_dir",
           "geometry_of_processor", "model_type_of_dir", "serve_settings", "served_geometry"]

#: model_type -> (the family's name, how its models write boxes)
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3_vl": ("Qwen3-VL", "relative-1000"),
    "qwen3_vl_moe": ("Qwen3-VL-MoE", "relative-1000"),
    "qwen2_5_vl": ("Qwen2.5-VL", "pixels"),
    "qwen2_vl": ("Qwen2-VL", "relative-1000"),
}
#: the image processor's own defaults where a saved config leaves a value out (transformers' Qwen2VLImageProcessor,
#: the one class every family here loads: patch, merge, min and max pixels)
PROCESSOR_DEFAULTS = (14, 2, 56 * 56, 28 * 28 * 1280)
#: SGLang 0.5.23 loads a Qwen2-VL processor with this size whatever the checkpoint saved
#: (``sglang/srt/utils/hf_transformers/processor.py``); ``--mm-process-config`` overrides it per call
SGLANG_QWEN2_VL_SIZE = (3136, 1003520)


def _normalise(name: str | None) -> str:
    return (name or "").lower().replace("-", "_").replace(".", "_")


def box_coordinates_of(model_type: str | None) -> str:
    """How a model family writes a grounding box's bbox_2d, by its ``model_type`` or its served name: 0-1000 relative
    coordinates (Qwen3-VL and later Qwen VL families, Qwen2-VL), or pixels of the image it was shown (Qwen2.5-VL);
    pixels when the family is unknown."""
    kind = _normalise(model_type)
    relative = ("qwen3_vl", "qwen3vl", "qwen3_5", "qwen3_omni", "qwen2_vl", "qwen2vl")
    return "relative-1000" if any(k in kind for k in relative) else "pixels"


def model_type_of_dir(path) -> str | None:
    """``model_type`` of a model directory's config.json (None when it is not a local directory)."""
    cfg = Path(str(path)) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type") if cfg.is_file() else None
    except (OSError, ValueError):
        return None


def cached_model_dir(model: str) -> str:
    """``model`` itself when it is a local directory, else the Hugging Face cache's snapshot of that hub name when its
    config is already downloaded (no network), else ``model``."""
    if Path(model).is_dir() or model.count("/") != 1:
        return model
    try:
        from huggingface_hub import try_to_load_from_cache  # a lookup in the local cache only
    except ImportError:
        return model
    found = try_to_load_from_cache(model, "config.json")
    return str(Path(found).parent) if isinstance(found, str) else model


def _size_of(section: dict) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a saved image-processor section, as the processor's ``__init__`` folds them
    (legacy ``min_pixels`` / ``max_pixels`` keys win over ``size``)."""
    size = section.get("size") if isinstance(section.get("size"), dict) else {}
    low = section.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or PROCESSOR_DEFAULTS[2]
    high = section.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or PROCESSOR_DEFAULTS[3]
    return int(low), int(high)


def geometry_of_dir(path) -> FrameGeometry | None:
    """The geometry a model directory's processor states (its ``processor_config.json``'s image processor, or a
    ``preprocessor_config.json``), read from the files; None when ``path`` is not a directory with one."""
    src = Path(str(path))
    sections = []
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        f = src / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        section = data.get(key) if key else data
        if isinstance(section, dict) and ("patch_size" in section or "size" in section or "min_pixels" in section):
            sections.append((name, section))
    if not sections:
        return None
    name, section = sections[0]
    family = model_type_of_dir(src)
    low, high = _size_of(section)
    return FrameGeometry(family, int(section.get("patch_size", PROCESSOR_DEFAULTS[0])),
                         int(section.get("merge_size", PROCESSOR_DEFAULTS[1])), low, high,
                         box_coordinates_of(family), f"{src / name}")


def geometry_of_processor(processor, family: str | None = None, source: str = "its processor") -> FrameGeometry:
    """The geometry a loaded processor (or image processor) applies: its ``patch_size``, ``merge_size`` and ``size``
    (``shortest_edge`` / ``longest_edge``)."""
    ip = getattr(processor, "image_processor", processor)
    size = getattr(ip, "size", None)

    def pick(*keys):
        for k in keys:
            v = size.get(k) if isinstance(size, dict) else getattr(size, k, None)
            if v:
                return int(v)
        return None

    low = pick("shortest_edge", "min_pixels") or getattr(ip, "min_pixels", None) or PROCESSOR_DEFAULTS[2]
    high = pick("longest_edge", "max_pixels") or getattr(ip, "max_pixels", None) or PROCESSOR_DEFAULTS[3]
    return FrameGeometry(family, int(getattr(ip, "patch_size", PROCESSOR_DEFAULTS[0]) or PROCESSOR_DEFAULTS[0]),
                         int(getattr(ip, "merge_size", PROCESSOR_DEFAULTS[1]) or PROCESSOR_DEFAULTS[1]),
                         int(low), int(high), box_coordinates_of(family), source)


def served_geometry(info: dict, fallback: FrameGeometry | None = None) -> FrameGeometry | None:
    """The geometry an SGLang server applies, from its ``/server_info`` (``model_path``, ``mm_process_config``): its
    model directory's processor (``fallback`` when that directory is not on this machine), with SGLang's own size for
    Qwen2-VL, under the ``--mm-process-config`` image settings it was started with."""
    model = info.get("model_path") or ""
    geometry = geometry_of_dir(model) or fallback
    if geometry is None:
        return None
    low, high = geometry.min_pixels, geometry.max_pixels
    if _normalise(geometry.family) == "qwen2_vl":
        low, high = SGLANG_QWEN2_VL_SIZE
    image = (info.get("mm_process_config") or {}).get("image") or {}
    size = image.get("size") if isinstance(image.get("size"), dict) else {}
    low = int(image.get("min_pixels") or size.get("shortest_edge") or low)
    high = int(image.get("max_pixels") or size.get("longest_edge") or high)
    return FrameGeometry(geometry.family, geometry.patch, geometry.merge, low, high, geometry.boxes,
                         f"the server's model {model}" if model else geometry.source)


def serve_settings(geometry: FrameGeometry) -> dict:
    """SGLang's ``--mm-process-config`` for a model of ``geometry``: its image processor told the sizes the client
    keeps frames at (:attr:`~paravt_agent.video.FrameGeometry.processor_size`: min one unit, max the model's). It also
    replaces SGLang's own Qwen2-VL size, which ignores the checkpoint's."""
    return {"image": {"size": dict(geometry.processor_size)}}


def check_vision_inputs(inputs: dict, image_token_id: int, merge: int, where: str) -> None:
    """Refuse (:class:`PolicyError`) model inputs with images whose ``mm_token_type_ids`` are missing or do not mark
    exactly the visual tokens of their patch grids: without them transformers' Qwen2.5-VL silently positions the
    images as text (and Qwen2-VL / Qwen3-VL raise deep in their forward). ``where`` names the builder."""
    grids = inputs.get("image_grid_thw")
    if grids is None or len(grids) == 0:
        return
    marks = inputs.get("mm_token_type_ids")
    if marks is None:
        raise PolicyError(f"{where}: the batch has images but no mm_token_type_ids; transformers' Qwen2.5-VL would "
                          "silently give its images text-only positions (and Qwen2-VL / Qwen3-VL refuse the batch). "
                          "The model's processor must list mm_token_type_ids in its model_input_names (transformers "
                          ">= 5); load the processor saved with the model")
    expected = sum(int(t) * int(h) * int(w) for t, h, w in (tuple(g) for g in grids.tolist())) // (merge * merge)
    ids = inputs["input_ids"]
    marked, placeholders = int((marks == 1).sum()), int((ids == image_token_id).sum())
    if not (marked == placeholders == expected):
        raise PolicyError(f"{where}: {marked} tokens are marked as image tokens and {placeholders} are image "
                          f"placeholders, but the patch grids hold {expected} visual tokens: the model would place "
                          "its images wrongly")
