"""Run under ``torch.distributed.run`` by ``tests/test_scale.py``: one trainer on this rank.

    scale_worker.py sft CONFIG.yaml [--sigterm-at STEP --sigterm-rank R]
                                         (a JSON line per rank: its rank, losses, steps, stop signal)
    scale_worker.py grpo CONFIG.yaml
    scale_worker.py online CONFIG.yaml --store PATH [--restart-server-at STEP]

``--sigterm-at`` sends SIGTERM to rank R's own process right after step STEP, as a scheduler would to one
node: every rank must stop at that step boundary with a checkpoint. ``--restart-server-at`` stands in for
the server restarting on the initial weights (version "default") once the trainer has made STEP updates, before
any rank rolls out the next one.
"""

import argparse
import json
import os
import signal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["sft", "grpo", "online"])
    ap.add_argument("config")
    ap.add_argument("--store", default=None)
    ap.add_argument("--sigterm-at", type=int, default=None)
    ap.add_argument("--sigterm-rank", type=int, default=0)
    ap.add_argument("--restart-server-at", type=int, default=None)
    args = ap.parse_args()
    from paravt_train.infra.distributed import end_process, shutdown_distributed

    if args.mode == "sft":
        from paravt_train.sft import train
        from paravt_train.sft.config import SFTConfig

        def callback(step: int, loss: float) -> None:
            if step == args.sigterm_at and int(os.environ.get("RANK", "0")) == args.sigterm_rank:
                os.kill(os.getpid(), signal.SIGTERM)

        out = train(SFTConfig.from_yaml(args.config), progress=False, callback=callback)
        said = {"rank": int(os.environ.get("RANK", "0")), "losses": out["losses"], "steps": out["steps"],
                "stopped": out["stopped"]}
        os.write(1, (json.dumps(said) + "\n").encode())  # one write: the ranks' lines never interleave
        end_process(0)  # the trainer destroyed its group; out as `paravt-train sft` ends
        return
    from paravt_train.online.config import OnlineConfig
    from paravt_train.rl.config import GRPOConfig

    cfg = (GRPOConfig if args.mode == "grpo" else OnlineConfig).from_yaml(args.config)
    try:  # as `paravt-train grpo|online` end: the group destroyed, then out without interpreter finalization
        if args.mode == "grpo":
            from paravt_train.rl.trainer import GRPOTrainer

            GRPOTrainer(cfg, progress=False).run()
        else:
            from paravt_train.online.learner import OnlineLearner

            learner = OnlineLearner(cfg, args.store, progress=False)
            if args.restart_server_at is not None:
                restart_server_at(learner.trainer, cfg, args.restart_server_at)
            learner.run(once=True)
    finally:
        shutdown_distributed()
    end_process(0)  # a rank left to finalization can abort after its last write (infra.distributed.end_process)


def restart_server_at(tr, cfg, at: int) -> None:
    """Before the update after ``at`` updates, every rank waits while rank 0 puts the initial weights back on
    the server as version "default" (its version 0), as a server restarted from its launch weights would."""
    import tempfile

    from paravt_train.infra.distributed import barrier
    from paravt_train.sync.disk import SGLangWeightSync

    step = tr.train_step

    def train_step(prompts, *a, **kw):
        if tr.step == at:
            barrier()
            if tr.rank == 0:
                SGLangWeightSync(cfg.endpoint, tempfile.mkdtemp()).serve(cfg.model, version="default")
            barrier()
        return step(prompts, *a, **kw)

    tr.train_step = train_step


if __name__ == "__main__":
    main()
