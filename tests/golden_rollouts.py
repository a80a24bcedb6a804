"""The RL rollouts' token ids on a fixed seed, as a digest: what ``test_rollout.py`` holds the graph to.

``python tests/golden_rollouts.py > tests/data/rollout_golden.json`` rewrites the file (only when a change of
the token stream is intended). Each case is one GRPO group of the shipped toy policy on the toy RL world
(summary and frames evidence); each trained sequence is summarised by its role, turn, slot, length, the
sha256 of its ids, mask and images, and its sampled ids themselves."""

from __future__ import annotations

import hashlib
import json
import sys

CASES = [
    {"name": "summary-mcq-n8", "task": "mcq", "n": 8, "layout": {}},
    {"name": "summary-tvg-n16", "task": "tvg", "n": 16, "layout": {}},
    {"name": "frames-mcq-n8", "task": "mcq", "n": 8, "layout": {"evidence": "frames"}},
]


def _sha(xs) -> str:
    return hashlib.sha256(json.dumps(list(xs)).encode()).hexdigest()[:16]


def digest(agent, world, case: dict) -> list[dict]:
    import numpy as np

    from paravt_train.data.records import PromptItem
    from paravt_train.rewards import RewardConfig
    from paravt_train.rl.rollout import PromptCache, RolloutSettings, run_group

    q = next(q for q in world.questions if q.task == case["task"])
    answer = [int(x) for x in q.span] if q.task == "tvg" else q.answer
    prompt = PromptItem(id=q.qid, video=world.video, question=q.question, options=q.options, answer=answer, task=q.task)
    settings = RolloutSettings(group=2, n_frames=case["n"], reward=RewardConfig(), seed=0)
    eps = agent.run(run_group(agent, PromptCache(agent), prompt, settings, agent.policy.eos_id))
    out = []
    for ep in eps:
        seqs = []
        for s in ep.sequences:
            img = hashlib.sha256(b"".join(np.ascontiguousarray(i).tobytes() for i in s.images)).hexdigest()[:16]
            seqs.append({"role": s.role, "turn": s.turn, "index": s.index, "len": len(s.input_ids),
                         "ids": _sha(s.input_ids), "mask": _sha(s.loss_mask), "images": img,
                         "sampled": [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]})
        out.append({"sample": ep.sample, "reward": round(ep.reward.total, 6), "sequences": seqs})
    return out


def agent_for(toy_policy_dir, layout: dict, policy=None):
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.local import LocalPolicy

    cfg = AgentConfig.for_model(toy_policy_dir).model_copy(deep=True)
    cfg = cfg.override([f"layout.{k}={v}" for k, v in layout.items()]
                       + ["planner_sampling.temperature=0.3", "subagent_sampling.temperature=0.3",
                          "planner_sampling.max_new_tokens=96", "subagent_sampling.max_new_tokens=40"])
    return Agent(policy=policy or LocalPolicy(toy_policy_dir), config=cfg)


def main() -> None:
    import tempfile
    from pathlib import Path

    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.world import make_worlds

    model = str(REPO_CHECKPOINT)
    worlds = make_worlds(range(910_000, 910_001), Path(tempfile.mkdtemp()) / "videos")
    policy = None
    result = {}
    for case in CASES:
        agent = agent_for(model, case["layout"], policy)
        policy = agent.policy
        result[case["name"]] = digest(agent, worlds[0], case)
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
