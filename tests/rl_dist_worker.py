"""Run under ``torch.distributed.run``: one GRPO update of pickled rollout items, this rank's share.

Usage: rl_dist_worker.py CONFIG.yaml ITEMS.pkl OUT.pt  (rank r takes items r, r + W, ...; rank 0 saves the
gathered weights and the update's statistics).
"""

import os
import pickle
import sys

import torch

from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.trainer import GRPOTrainer


def main() -> None:
    cfg_path, items_path, out_path = sys.argv[1:4]
    # no server behind the endpoint: the update alone is compared (no push at setup)
    tr = GRPOTrainer(GRPOConfig.from_yaml(cfg_path), progress=False, log=lambda *_: None, push_updates=False)
    tr.setup()
    with open(items_path, "rb") as f:
        items = pickle.load(f)
    stats = tr.policy_update(items[tr.rank :: tr.world])
    from paravt_train.sync.streamed import stream_parameters

    state = {k: v.cpu() for k, v in stream_parameters(tr.model)}
    if tr.rank == 0:  # the whole step's statistics: every rank's share
        import torch.distributed as dist

        shards = [None] * tr.world
        dist.gather_object(stats, shards)
        torch.save({"state": state, "stats": {**stats, "sequences": sum(s["sequences"] for s in shards),
                                             "trained_tokens": sum(s["trained_tokens"] for s in shards)}}, out_path)
    else:
        import torch.distributed as dist

        dist.gather_object(stats, None)
    torch.distributed.destroy_process_group()
    # no interpreter finalization: a Gloo worker thread may still hold tensors then, and freeing them aborts
    # the process after its work is done (pytorch/pytorch#179291; seen once in the suite, rank 1, SIGABRT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
