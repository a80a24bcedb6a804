"""Run under ``torch.distributed.run`` by ``tests/test_scale.py``: one trainer on this rank.

    scale_worker.py sft CONFIG.yaml          (prints the losses as JSON)
    scale_worker.py grpo CONFIG.yaml
    scale_worker.py online CONFIG.yaml --store PATH
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["sft", "grpo", "online"])
    ap.add_argument("config")
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    if args.mode == "sft":
        from paravt_train.sft import train
        from paravt_train.sft_config import SFTConfig

        out = train(SFTConfig.from_yaml(args.config), progress=False)
        print(json.dumps({"losses": out["losses"]}))
        return
    from paravt_train.distributed import shutdown_distributed
    from paravt_train.grpo_config import GRPOConfig

    cfg = GRPOConfig.from_yaml(args.config)
    try:  # as `paravt-train grpo|online` end
        if args.mode == "grpo":
            from paravt_train.grpo_trainer import GRPOTrainer

            GRPOTrainer(cfg, progress=False).run()
        else:
            from paravt_train.online import OnlineLearner

            OnlineLearner(cfg, args.store, progress=False).run(once=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
