"""Run under ``torch.distributed.run``: one GRPO update of pickled rollout items, this rank's share.

Usage: rl_dist_worker.py CONFIG.yaml ITEMS.pkl OUT.pt  (rank r takes items r, r + W, ...; rank 0 saves the
gathered weights and the update's statistics).
"""

import pickle
import sys

import torch

from paravt_train.rl import GRPOConfig, GRPOTrainer


def main() -> None:
    cfg_path, items_path, out_path = sys.argv[1:4]
    tr = GRPOTrainer(GRPOConfig.from_yaml(cfg_path), progress=False, log=lambda *_: None)
    tr.setup()
    with open(items_path, "rb") as f:
        items = pickle.load(f)
    stats = tr._update(items[tr.rank :: tr.world])
    state = tr.full_state_dict()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}
    if tr.rank == 0:
        torch.save({"state": state, "stats": stats}, out_path)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
