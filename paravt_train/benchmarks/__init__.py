"""Benchmark loaders: one module per benchmark, each turning the published files into :class:`EvalItem` s.

===============  ============================================================
``videomme``     VideoMME, without subtitles (:mod:`.videomme`)
``videomme_sub`` VideoMME with subtitles in the question
``longvideobench`` LongVideoBench validation (:mod:`.longvideobench`)
``lvbench``      LVBench (:mod:`.lvbench`)
``mlvu``         MLVU dev, the multiple-choice tasks (M-Avg) (:mod:`.mlvu`)
``mlvu_generation`` MLVU dev, the generation tasks as open-ended (token F1, a proxy)
``mmvu``         MMVU validation (:mod:`.mmvu`)
``charades``     Charades-STA test, temporal grounding (:mod:`.charades`)
``toy``          the toy benchmark of ``paravt-train toy`` (:mod:`.toy`)
===============  ============================================================

Adding one: a module with ``load_<name>(root: Path) -> list[EvalItem]``, registered
here or through the ``paravt.benchmarks`` entry-point group (an entry point names
the loader function).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from paravt_agent.plugins import load_entry_points
from paravt_train.benchmarks.base import BenchmarkError, EvalItem
from paravt_train.benchmarks.charades import load_charades
from paravt_train.benchmarks.longvideobench import load_longvideobench
from paravt_train.benchmarks.lvbench import load_lvbench
from paravt_train.benchmarks.mlvu import load_mlvu, load_mlvu_generation
from paravt_train.benchmarks.mmvu import load_mmvu
from paravt_train.benchmarks.toy import load_toy
from paravt_train.benchmarks.videomme import load_videomme

__all__ = ["BENCHMARKS", "BenchmarkError", "EvalItem", "available_benchmarks", "folder_of", "load_benchmark"]

log = logging.getLogger(__name__)

BENCHMARKS: dict[str, Callable[[Path], list[EvalItem]]] = {
    "videomme": load_videomme,
    "videomme_sub": lambda root: load_videomme(root, subtitles=True),
    "longvideobench": load_longvideobench,
    "lvbench": load_lvbench,
    "mlvu": load_mlvu,
    "mlvu_generation": load_mlvu_generation,
    "mmvu": load_mmvu,
    "charades": load_charades,
    "toy": load_toy,
}


#: Benchmarks read from another one's folder (the same download).
SHARED_FOLDERS = {"videomme_sub": "videomme", "mlvu_generation": "mlvu"}


def folder_of(name: str) -> str:
    """The folder name a benchmark's files live in under the data root."""
    return SHARED_FOLDERS.get(name, name)


def available_benchmarks() -> list[str]:
    """The built-in loaders and every ``paravt.benchmarks`` entry point."""

    return list(load_entry_points("paravt.benchmarks", BENCHMARKS, "benchmark"))


def load_benchmark(name: str, root: str | Path, check_videos: bool = True) -> list[EvalItem]:
    names = available_benchmarks()
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; choose from {', '.join(names)}")
    root = Path(root)
    if not root.exists():
        raise BenchmarkError(f"{name}: benchmark folder not found: expected {root}")
    items = BENCHMARKS[name](root)
    if check_videos:
        missing = [it.video for it in items if not Path(it.video).is_file()]
        if missing:
            raise BenchmarkError(f"{name}: {len(missing)} of {len(items)} videos missing, e.g. expected {missing[0]}")
    return items
