"""``paravt-train toy``: build the toy world's data and tiny policy, and train it with ParaVT's own SFT.

Cached: the output folder records the build settings; a second run with the same
settings returns at once.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError
from paravt_train.data import write_parquet
from paravt_train.infra.tracking import ReportTo
from paravt_train.sft import train
from paravt_train.sft.config import SFTConfig
from paravt_train.toy import methods as methods_module
from paravt_train.toy import tiny, world
from paravt_train.toy.methods import method_rows, toy_agent_config
from paravt_train.toy.rows import check_trace_roundtrip, copy_rows, corpus, rl_rows, sft_rows
from paravt_train.toy.tiny import build_tiny_model, copy_vocabulary, copy_warmup
from paravt_train.toy.world import make_worlds
from tools import ToolRegistry

__all__ = ["ToyConfig", "ToyStage", "build", "toy_agent_config", "TEST_SEED0"]

TEST_SEED0 = 900_000  # held-out worlds use seeds from here: disjoint from the training videos


Plans = Literal["copy", "neighbours"]  # world.PLANS


class ToyStage(BaseModel):
    """A further SFT stage on the same worlds (its own plans), starting from the previous stage's policy (a warm
    start)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(ge=1, description="SFT steps of this stage.")
    lr: float = Field(gt=0, description="Its peak learning rate (warmup, then cosine).")
    plans: Plans = Field("copy", description="The plans of this stage's traces (world.PLANS).")


class ToyConfig(BaseModel):
    """The toy world's build: how many videos and questions, the tiny model, its SFT."""

    model_config = ConfigDict(extra="forbid")

    out: str = Field(description="Output folder (data, videos, model).")
    train_worlds: int = Field(400, ge=1, description="Training videos.")
    test_worlds: int = Field(60, ge=1, description="Held-out videos (disjoint seeds).")
    mcq: int = Field(4, ge=0, description="Colour-at-t multiple-choice questions per training video.")
    oe: int = Field(2, ge=0, description="Colour-at-t open-ended questions per training video.")
    tvg: int = Field(2, ge=0, le=2, description="Grounding questions per training video (at most 2: the unique "
                                                "colours).")
    seed: int = Field(0, description="World and training seed.")
    size: str = Field("toy", description="Tiny model size: toy (~1.3 M parameters) or test.")
    vocab_size: int = Field(1024, ge=300, description="Byte-level BPE vocabulary trained on the toy corpus.")
    steps: int = Field(1800, ge=1, description="SFT steps of the first stage.")
    batch_size: int = Field(16, ge=1, description="SFT samples per step.")
    lr: float = Field(1e-3, gt=0, description="SFT peak learning rate of the first stage (warmup, then cosine).")
    warmup_ratio: float = Field(0.05, ge=0, le=1, description="SFT warmup, as a fraction of the steps.")
    copy_rows: int = Field(10, ge=0, description="Text-only copy rows (random sequences of the tokenizer's "
                                                 "ordinary tokens, repeated) per training video in the SFT mix: "
                                                 "they keep the copy skill the warm-up taught, which the SFT erases "
                                                 "without them (see rows.copy_sample; README, the toy world).")
    copy_steps: int = Field(1500, ge=0, description="Copy warm-up steps of a fresh tiny model before the SFT (the "
                                                  "stand-in for pretraining; see tiny.copy_warmup; 1500 forms the "
                                                  "skill at the toy size); 0 skips it. Not run for a warm start.")
    copy_length: tuple[int, int] = Field(
        (20, 80),
        description="Shortest and longest sequence of the copy rows (tokenizer pieces) and of the warm-up's "
                    "reach stage (tokens). A copy learned on short sequences does not reach further back (README, "
                    "the toy world); the grounding answer step copies listing entries from up to ~800 tokens back.",
    )
    copy_reach_steps: int = Field(0, ge=0, description="Warm-up steps after the copy_steps (which use 20-80 tokens) "
                                                       "that extend the copy to copy_length sequences: a third at "
                                                       "half that length, then the rest (tiny.copy_warmup). 0 skips "
                                                       "them.")
    copy_listing_steps: int = Field(0, ge=0, description="Warm-up steps, after all others, that copy random "
                                                         "listings of the toy's colours and seconds (rows."
                                                         "random_listing): a copy that must match several tokens "
                                                         "back, which random-token copies do not teach. 0 skips them.")
    number_tokens: bool = Field(True, description="Give the fresh model's tokenizer one token per whole number "
                                                  "0-255 (tiny.NUMBER_TOKENS), so every time is one token, the same "
                                                  "in a frame label, a question, a plan, a listing and an answer, "
                                                  "and each copy of it a one-token lookup; off, numbers are digits "
                                                  "(README, the toy world).")
    copy_row_kind: Literal["tokens", "listings"] = Field("tokens", description="What the copy rows repeat: random "
                                                         "tokens or random listings (rows.copy_rows).")
    micro_batch_size: int = Field(1, description="1 is fastest on CPU: no padding, causal attention kernels.")
    plans: Plans = Field("neighbours", description="The plans of the first stage's traces (world.PLANS): "
                                                   "neighbours (colour-at-t crops [t, t+1] and [t-1, t], grounding "
                                                   "scans forward), the curriculum's first stage; copy, the "
                                                   "shipped policy's plans (README, the toy world).")
    then: list[ToyStage] = Field(
        default_factory=lambda: [ToyStage(steps=500, lr=5e-4), ToyStage(steps=400, lr=5e-4)],
        description="Further SFT stages after the first, each a warm start from the one before on the same "
                    "worlds with its own plans (default: 500 and 400 steps at lr 5e-4 on the copy plans, the "
                    "shipped policy's recipe, checkpoints/toy/COMMAND.txt); [] trains the first stage only.")
    init: str | None = Field(None, description="Start the SFT from this policy directory (its tokenizer and "
                                               "weights) instead of a fresh tiny model: a warm start, one stage on "
                                               "the copy plans unless plans or then are given.")
    methods: list[Literal["weaver", "collab"]] = Field(
        default_factory=list, description="The related methods whose traces join every stage's SFT rows, beside "
        "ParaVT's (toy/methods.py): weaver (Weaver's tool loop: trim, temporal_grounding with its model calls, frames "
        "in the context) and collab (VideoChat-M1's agents: plan, decision, answer, reason summary). [] = ParaVT's "
        "traces only (the shipped policy's recipe).")
    method_worlds: int | None = Field(None, ge=1, description="How many of the training worlds get the methods' "
                                      "traces (the first ones); None = all.")
    report_to: ReportTo = Field(default_factory=list, description="Experiment trackers of the SFT (SFTConfig."
                                 "report_to: tensorboard, mlflow, wandb, trackio); not part of the build's digest.")

    @model_validator(mode="after")
    def _warm_start_is_one_stage(self) -> ToyConfig:
        # a warm start fine-tunes a trained policy: on the shipped plans, one stage, unless told otherwise
        if self.init and "plans" not in self.model_fields_set:
            self.plans = "copy"
        if self.init and "then" not in self.model_fields_set:
            self.then = []
        return self

    @field_validator("copy_length")
    @classmethod
    def _ordered(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 2 <= v[0] <= v[1]:
            raise ValueError(f"copy_length must be (shortest, longest) with 2 <= shortest <= longest, got {v}")
        return v

    def digest(self) -> str:
        """Settings plus the source of the world and model recipes: a changed trace format rebuilds."""

        unset = {k for k in ("methods", "method_worlds") if not getattr(self, k)}  # absent: the digests before them
        data = self.model_dump(exclude={"out", "report_to", *unset})
        h = hashlib.sha256(json.dumps(data, sort_keys=True).encode())
        for mod in (world, tiny, *((methods_module,) if self.methods else ())):
            h.update(Path(mod.__file__).read_bytes())
        if self.init:  # a warm start depends on the weights it starts from
            for f in sorted(Path(self.init).glob("*.safetensors")):
                h.update(f.read_bytes())
        return h.hexdigest()[:16]


def build(cfg: ToyConfig, progress: bool = True, log=print) -> Path:
    """Data + model + SFT; returns the trained model directory."""

    if cfg.init and not (Path(cfg.init) / "config.json").is_file():
        raise ConfigError(f"init: {cfg.init} is not a model directory (no config.json)")
    out = Path(cfg.out)
    stamp = out / "toy.json"
    model_dir = out / "model"
    cached = stamp.is_file() and (model_dir / "config.json").is_file()
    if cached and json.loads(stamp.read_text()).get("digest") == cfg.digest():
        log(f"toy policy already built: {model_dir}")
        return model_dir
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_w = make_worlds(range(cfg.seed, cfg.seed + cfg.train_worlds), out / "videos", progress,
                          mcq=cfg.mcq, oe=cfg.oe, tvg=cfg.tvg)
    test_w = make_worlds(range(TEST_SEED0 + cfg.seed, TEST_SEED0 + cfg.seed + cfg.test_worlds), out / "videos",
                         progress)
    schema = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()
    plans = [cfg.plans, *(st.plans for st in cfg.then)]
    rows = {p: sft_rows(train_w, schema, seed=cfg.seed, video_root=out / "videos", plans=p)
            for p in dict.fromkeys(plans)}
    if cfg.methods:  # the related methods' traces join every stage's rows
        extra = method_rows(train_w[: cfg.method_worlds], cfg.methods, seed=cfg.seed, video_root=out / "videos")
        rows = {p: r + extra for p, r in rows.items()}
    for r in rows.values():
        check_trace_roundtrip(r)
    if cfg.init:
        init = Path(cfg.init)
        log(f"warm start from {init}")
    else:  # the tokenizer learns the first stage's texts
        init = build_tiny_model(out / "init", corpus(rows[cfg.plans]), size=cfg.size, vocab_size=cfg.vocab_size,
                                seed=cfg.seed, number_tokens=cfg.number_tokens)
        if cfg.copy_steps:
            warm = copy_warmup(init, steps=cfg.copy_steps, seed=cfg.seed, reach_steps=cfg.copy_reach_steps,
                               reach_length=cfg.copy_length, listing_steps=cfg.copy_listing_steps,
                               progress=progress, log=log)
            key = "accuracy_listings" if cfg.copy_listing_steps else "accuracy_after"
            if warm[key] < 0.9:
                log(f"warning: the copy warm-up reached only {warm[key]:.2f} copy accuracy; the grounding "
                    f"copies need it (raise {'copy_listing_steps' if cfg.copy_listing_steps else 'copy_steps'})")
    data = {p: _write_sft_data(r, cfg, init, len(train_w), out / "data", p) for p, r in rows.items()}
    write_parquet(rl_rows(train_w, out / "videos"), out / "data" / "rl_train.parquet")
    write_parquet(rl_rows(test_w, out / "videos"), out / "data" / "rl_test.parquet")
    log(f"toy data: {len(train_w)} training videos, {len(test_w)} held-out videos, SFT samples "
        + ", ".join(f"{len(r) + cfg.copy_rows * len(train_w)} ({p} plans)" for p, r in rows.items())
        + f" ({time.time() - t0:.0f}s)")
    agent_cfg = toy_agent_config()
    sft = SFTConfig(
        model=str(init), data=str(data[cfg.plans]), video_root=str(out / "videos"),
        output_dir=str(out / "sft"), frames=agent_cfg.frames, lr=cfg.lr, batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size, max_steps=cfg.steps, warmup_ratio=cfg.warmup_ratio, save_every=200,
        seed=cfg.seed, report_to=cfg.report_to,
    )
    result = train(sft, progress=progress)
    final = out / "sft" / "final"
    for k, stage in enumerate(cfg.then, 2):  # warm starts on the same worlds, each from the stage before
        log(f"stage {k}: {stage.steps} steps at lr {stage.lr:g} on the {stage.plans} plans from {final}")
        result = train(sft.model_copy(update={"model": str(final), "output_dir": str(out / f"sft-stage{k}"),
                                              "data": str(data[stage.plans]), "lr": stage.lr,
                                              "max_steps": stage.steps}), progress=progress)
        final = out / f"sft-stage{k}" / "final"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(final, model_dir)
    (model_dir / "agent_config.yaml").write_text(_yaml(agent_cfg))
    stamp.write_text(json.dumps({"digest": cfg.digest(), "config": cfg.model_dump(), "final_loss": result["losses"][-1],
                                 "minutes": (time.time() - t0) / 60}))
    log(f"toy policy trained: {cfg.steps + sum(st.steps for st in cfg.then)} steps in {1 + len(cfg.then)} stage(s), "
        f"final loss {result['losses'][-1]:.4f}, "
        f"{(time.time() - t0) / 60:.1f} min -> {model_dir}")
    return model_dir


def _write_sft_data(rows: list[dict], cfg: ToyConfig, init: Path, videos: int, folder: Path, plans: str) -> Path:
    """One plans' SFT rows plus the copy rows (``cfg.copy_rows`` per training video, drawn from the policy's own
    tokenizer, so they exist only once it does), shuffled, written as ``sft_train[_PLANS].parquet``."""
    from transformers import AutoTokenizer


    if cfg.copy_rows:
        rows = rows + copy_rows(cfg.copy_rows * videos, copy_vocabulary(AutoTokenizer.from_pretrained(init)),
                                seed=cfg.seed, length=cfg.copy_length, kind=cfg.copy_row_kind)
        random.Random(cfg.seed).shuffle(rows)
    path = folder / ("sft_train.parquet" if plans == "copy" else f"sft_train_{plans}.parquet")
    write_parquet(rows, path)
    return path


def _yaml(cfg: AgentConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
