"""What every training loop stands on: torchrun/FSDP2 helpers (:mod:`~paravt_train.infra.distributed`), atomic
checkpoints and exact resume (:mod:`~paravt_train.infra.checkpoint`), SIGTERM as a stop at a step boundary
(:mod:`~paravt_train.infra.interrupt`), and the run's metrics and trackers (:mod:`~paravt_train.infra.tracking`)."""
