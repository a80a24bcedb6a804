"""A setting built to be learnable in seconds on CPU, shared by the learning tests: twelve tiny videos, one
open-ended question ("Which word goes with this video?") scored by token F1, a tiny Qwen3-VL-architecture model,
and SFT starts that answer one of two words most of the time (60 / 40), so RL has room to move them."""

from __future__ import annotations

from pathlib import Path

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.prompts import NO_TOOL_SYSTEM_PROMPT, question_text
from paravt_train.benchmarks import EvalItem
from paravt_train.data import write_parquet
from paravt_train.eval import evaluate_items
from paravt_train.toy.render import write_segments

QUESTION = "Which word goes with this video?"
THINK = "<think>\nA word for this video.</think>\n"
COLOURS = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (255, 225, 25)]
TRAIN, HELD = range(8), range(8, 12)


def rl_rows(videos, answer: str = "red") -> list[dict]:
    return [{"id": f"q{v}", "prompt": [{"role": "user", "content": QUESTION}], "videos": [f"v{v}.mp4"],
             "answer": answer, "question_type": "oe", "question": QUESTION} for v in videos]


def heldout(agent: Agent, root, answer: str) -> list[float]:
    items = [EvalItem(benchmark="held", uid=f"h{v}", video=str(root / f"v{v}.mp4"), question=QUESTION,
                      task="oe", answer=answer) for v in HELD]
    return [r["f1"] for r in agent.run(evaluate_items(agent, items, concurrency=4, progress=False))]


def build(d: Path, majority: str = "blue", minority: str = "red", base: str | None = None) -> dict:
    """Videos, a tiny model (unless ``base`` is given) and an SFT start answering ``majority`` 60 % of the time."""
    from paravt_train.sft import train
    from paravt_train.sft.config import SFTConfig
    from paravt_train.toy.tiny import build_tiny_model

    for v in range(12):
        if not (d / f"v{v}.mp4").is_file():
            write_segments(d / f"v{v}.mp4", [(COLOURS[(v + i) % 4], 1.0) for i in range(4)], fps=4, width=32,
                           height=32)
    rows = []
    for v in TRAIN:
        for k in range(10):
            rows.append({"id": f"s{v}-{k}", "messages": [
                {"role": "system", "content": NO_TOOL_SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "video", "video": f"v{v}.mp4"},
                                             {"type": "text", "text": question_text(QUESTION)}]},
                {"role": "assistant", "content": f"{THINK}<answer>{minority if k < 4 else majority}</answer>"}]})
    write_parquet(rows, d / f"sft-{majority}.parquet")
    write_parquet(rl_rows(TRAIN), d / "rl.parquet")
    write_parquet(rl_rows(HELD), d / "held.parquet")
    if base is None:
        corpus = [NO_TOOL_SYSTEM_PROMPT, question_text(QUESTION), THINK + "<answer>red</answer>",
                  THINK + "<answer>blue</answer>"] * 4
        base = str(build_tiny_model(d / "base", corpus, size="test"))
        (Path(base) / "agent_config.yaml").write_text(AgentConfig(mode="none", frames={"max_pixels": 1024}).to_yaml())
    cfg = SFTConfig(model=base, data=str(d / f"sft-{majority}.parquet"), video_root=str(d),
                    output_dir=str(d / f"sft-{majority}"), lr=3e-3, batch_size=8, micro_batch_size=8, max_steps=200,
                    warmup_ratio=0.0, save_every=0, frames={"max_pixels": 1024}, seed=0)
    result = train(cfg, progress=False)
    return {"dir": d, "base": base, "sft": str(d / f"sft-{majority}" / "final"), "sft_result": result}
