"""Training data: the SFT and RL Parquet formats, validation and rendering (:mod:`~paravt_train.data.formats`),
the converter that merges independent sequential crops into one parallel turn (:mod:`~paravt_train.data.convert`),
and the RL pre-filters (:mod:`~paravt_train.data.prefilter`). ``from paravt_train.data import load_sft`` etc."""

from paravt_train.data.formats import (
    DataError,
    Message,
    RLSample,
    SFTSample,
    check_renderable,
    iter_rows,
    load_rl,
    load_sft,
    prompts_from_rl,
    render_messages,
    resolve_video,
    validate_file,
    write_parquet,
)

__all__ = [
    "DataError",
    "Message",
    "RLSample",
    "SFTSample",
    "check_renderable",
    "iter_rows",
    "load_rl",
    "load_sft",
    "prompts_from_rl",
    "render_messages",
    "resolve_video",
    "validate_file",
    "write_parquet",
]
