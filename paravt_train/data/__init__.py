"""Training data: the SFT and RL Parquet formats, validation and rendering (:mod:`~paravt_train.data.formats`),
the records they become (:mod:`~paravt_train.data.records`: ``PromptItem``, the transcript a reward scores), the
converter that merges independent sequential crops into one parallel turn (:mod:`~paravt_train.data.convert`), and
the RL pre-filters (:mod:`~paravt_train.data.prefilter`). ``from paravt_train.data import load_sft`` etc.

Below the loops that read it: nothing here imports :mod:`paravt_train.rl` (tests/test_architecture.py)."""

from paravt_train.data.formats import (
    DataError,
    Message,
    RLSample,
    SFTSample,
    check_renderable,
    detect_kind,
    group_errors,
    iter_rows,
    load_rl,
    load_sft,
    prompts_from_rl,
    render_messages,
    resolve_video,
    validate_file,
    write_parquet,
)
from paravt_train.data.records import PromptItem, episode_transcript

__all__ = [
    "DataError",
    "Message",
    "PromptItem",
    "RLSample",
    "SFTSample",
    "check_renderable",
    "episode_transcript",
    "iter_rows",
    "load_rl",
    "load_sft",
    "prompts_from_rl",
    "render_messages",
    "resolve_video",
    "detect_kind",
    "group_errors",
    "validate_file",
    "write_parquet",
]
