"""Evaluation: answering and scoring benchmark items (:mod:`~paravt_train.eval.run`: ``paravt-train eval``, the
results table with its error rate, RL's held-out scores), confidence intervals (:mod:`~paravt_train.eval.stats`)
and training curves (:mod:`~paravt_train.eval.plot`)."""

from paravt_train.eval.run import (
    BENCHMARKS,
    BenchmarkError,
    EvalItem,
    evaluate_items,
    heldout_scores,
    load_benchmark,
    results_table,
    run_eval,
    score_item,
)

__all__ = [
    "BENCHMARKS",
    "BenchmarkError",
    "EvalItem",
    "evaluate_items",
    "heldout_scores",
    "load_benchmark",
    "results_table",
    "run_eval",
    "score_item",
]
