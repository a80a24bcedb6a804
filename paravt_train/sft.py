"""Supervised fine-tuning (the cold start): loss on assistant tokens only, real processor and chat template.

Readable top to bottom: config → examples → loop. What it does:

* Every sample's messages are rendered by the agent's own prompt code
  (:func:`paravt_train.data.render_messages`), put through the model's chat
  template and processor; labels are the assistant turns' tokens (their
  ``<|im_end|>`` included); system, user and tool-response turns are masked.
* The loss of a global batch is the sum of token losses divided by the number
  of target tokens in the whole global batch (all micro-batches, all ranks), so
  gradient accumulation and data parallelism give the same gradient as one big
  batch.
* AdamW with linear warmup then cosine decay; full fine-tuning or LoRA (peft);
  gradient checkpointing; bf16 autocast on GPUs.
* A checkpoint every ``save_every`` steps holds model, optimizer, scheduler, RNG
  and the step (the data order is a function of seed and epoch), saved with
  ``torch.distributed.checkpoint``; ``resume`` continues exactly.
* Under ``torchrun`` the model is sharded with FSDP2 (``fully_shard`` per decoder
  layer); gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from paravt_agent.config import FrameConfig, load_yaml_model

__all__ = ["LoraSettings", "SFTConfig", "assistant_labels", "build_example", "collate", "train"]


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names (suffixes) to adapt; the vision tower's `qkv`/`proj` are left out by default.",
    )


class SFTConfig(BaseModel):
    """SFT settings; defaults follow the paper (Appendix B: lr 2e-5, batch 32, checkpoints every 100 steps)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Model directory (a Qwen3-VL / Qwen2.5-VL checkpoint).")
    data: str = Field(description="SFT Parquet file or dataset directory.")
    video_root: str | None = Field(None, description="Relative video paths are resolved against this.")
    output_dir: str = "runs/sft"
    frames: FrameConfig = Field(default_factory=FrameConfig, description="Frame protocol for video parts.")
    lr: float = 2e-5
    batch_size: int = Field(32, description="Global batch (samples per optimizer step, all ranks).")
    micro_batch_size: int = Field(4, description="Samples per forward pass on one rank.")
    max_steps: int | None = Field(None, description="Optimizer steps; None = `epochs` over the data.")
    epochs: float = 1.0
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_every: int = 100
    log_every: int = 1
    seed: int = 0
    gradient_checkpointing: bool = False
    bf16: str = Field("auto", description="auto (on GPUs), true or false.")
    lora: LoraSettings = Field(default_factory=LoraSettings)
    resume: bool = Field(True, description="Continue from the newest checkpoint in output_dir, if any.")
    save_final: bool = True

    @classmethod
    def from_yaml(cls, path, overrides=None) -> SFTConfig:
        return load_yaml_model(cls, path, overrides)


# --------------------------------------------------------------------------- examples


def assistant_labels(input_ids: list[int], tokenizer, keep: list[bool] | None = None) -> list[int]:
    """Labels: the ids of assistant turns (through their ``<|im_end|>``), -100 elsewhere.

    ``keep[k]`` False leaves the k-th assistant turn out of the loss (context only).
    """
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = tokenizer("assistant\n", add_special_tokens=False)["input_ids"]
    labels = [-100] * len(input_ids)
    i, n, turn = 0, len(input_ids), 0
    while i < n:
        if input_ids[i] == start and input_ids[i + 1 : i + 1 + len(header)] == header:
            train = keep is None or turn >= len(keep) or keep[turn]
            turn += 1
            j = i + 1 + len(header)
            while j < n and input_ids[j] != end:
                if train:
                    labels[j] = input_ids[j]
                j += 1
            if j < n and train:
                labels[j] = end
            i = j
        i += 1
    return labels


def build_example(messages: list[dict], processor, keep_frames: bool = False) -> dict:
    """Tokenised inputs + labels of one conversation (neutral message layout, frames included).

    ``keep_frames`` keeps the 8-bit frames instead of their pixel values (8x smaller in float32
    terms); :func:`collate` runs the image processor on them, giving identical pixel values.
    """
    import numpy as np

    from paravt_agent.policy.local import to_hf_messages

    chat, images = to_hf_messages(messages)
    text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    keep = [m.get("train", True) for m in messages if m["role"] == "assistant"]
    ex = {"input_ids": ids, "labels": assistant_labels(ids, processor.tokenizer, keep)}
    if keep_frames and images:
        ex["frames"] = [np.asarray(img) for img in images]
    else:
        for k in ("pixel_values", "image_grid_thw"):
            if k in enc:
                ex[k] = enc[k]
    if "mm_token_type_ids" in enc:
        ex["mm_token_type_ids"] = enc["mm_token_type_ids"][0].tolist()
    return ex


def collate(examples: list[dict], pad_id: int, image_processor=None) -> dict:
    """Right-pad a micro-batch; images concatenate in order (frames kept by ``build_example`` are
    turned into pixel values here by ``image_processor``)."""
    import torch

    n = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), n), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), n), dtype=torch.long),
        "labels": torch.full((len(examples), n), -100, dtype=torch.long),
    }
    has_mm = any("mm_token_type_ids" in e for e in examples)
    if has_mm:
        batch["mm_token_type_ids"] = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        L = len(e["input_ids"])
        batch["input_ids"][i, :L] = torch.tensor(e["input_ids"])
        batch["attention_mask"][i, :L] = 1
        batch["labels"][i, :L] = torch.tensor(e["labels"])
        if has_mm and "mm_token_type_ids" in e:
            batch["mm_token_type_ids"][i, :L] = torch.tensor(e["mm_token_type_ids"])
    frames = [f for e in examples for f in e.get("frames", ())]
    if frames:
        if image_processor is None:
            raise ValueError("examples keep frames: collate needs the image processor")
        if any("pixel_values" in e for e in examples):
            raise ValueError("a micro-batch mixes kept frames and pixel values")
        enc = image_processor(images=frames, return_tensors="pt")
        batch["pixel_values"], batch["image_grid_thw"] = enc["pixel_values"], enc["image_grid_thw"]
        return batch
    pix = [e["pixel_values"] for e in examples if "pixel_values" in e]
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in examples if "image_grid_thw" in e])
    return batch


def token_loss_sum(model, batch: dict):
    """Sum of next-token cross-entropies over labelled tokens, and their count."""
    import torch

    labels = batch.pop("labels")
    out = model(**batch, use_cache=False)
    logits = out.logits[:, :-1].float()
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, int((target != -100).sum())


# --------------------------------------------------------------------------- the loop


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _maybe_init_distributed():
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def load_model(cfg: SFTConfig, device):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(cfg.model)
    use_bf16 = cfg.bf16 == "true" or (cfg.bf16 == "auto" and device.type == "cuda")
    model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32).to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lc = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                        target_modules=cfg.lora.target_modules, bias="none")
        model = get_peft_model(model, lc)
    return model, processor, use_bf16


def _shard(model):
    """FSDP2: shard each decoder layer, then the root."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = _dist()[1]
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))
    for name, module in model.named_modules():
        if name.endswith("language_model.layers") or name.endswith("visual.blocks"):
            for layer in module:
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _vision_keepalive(model, device):
    """0 × a dummy vision forward, for micro-batches without images: every rank's vision
    parameters then take part in the backward (FSDP collectives must match)."""
    import torch

    visual = next((m for n, m in model.named_modules() if n.endswith("visual")), None)
    if visual is None:
        return 0.0
    cfg = visual.config if hasattr(visual, "config") else None
    patch = getattr(cfg, "patch_size", 16)
    tps = getattr(cfg, "temporal_patch_size", 2)
    merge = getattr(cfg, "spatial_merge_size", 2)
    pix = torch.zeros((merge * merge, 3 * tps * patch * patch), device=device)
    grid = torch.tensor([[1, merge, merge]], device=device)
    out = visual(pix, grid_thw=grid)
    first = out[0] if isinstance(out, tuple | list) else getattr(out, "last_hidden_state", out)
    if hasattr(out, "pooler_output") and out.pooler_output is not None:
        first = out.pooler_output
    return 0.0 * first.float().sum()


def _order(n: int, seed: int, epoch: int) -> list[int]:
    import random

    idx = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(idx)
    return idx


def _latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    done = [c for c in ckpts if (c / "trainer_state.json").is_file()]
    return done[-1] if done else None


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, extra: dict | None = None,
                    blobs: dict | None = None) -> None:
    """Model + optimizer (DCP, sharded under FSDP), scheduler, RNG, ``extra`` (JSON) and ``blobs`` (pickled),
    written to a temporary folder and renamed: a crash mid-save leaves the previous checkpoint whole."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, _ = _dist()
    tmp = path.with_name(path.name + ".tmp")
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "blobs": blobs or {}},
                   tmp / "extra.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(extra or {})}))
    _barrier()
    if rank == 0:
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)  # complete checkpoints only: a crash mid-save leaves the old one usable
    _barrier()


def load_checkpoint(path: Path, model, optimizer, scheduler) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(path / "extra.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    return json.loads((path / "trainer_state.json").read_text())["step"]


def load_blobs(path: Path) -> dict:
    """The ``blobs`` a checkpoint was saved with."""
    import torch

    return torch.load(path / "extra.pt", weights_only=False).get("blobs", {})


def _barrier():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_final(model, processor, out: Path, cfg: SFTConfig) -> None:
    """A plain model directory (LoRA merged, full state dict) that `from_pretrained` and the agent load."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank, world = _dist()
    if world > 1:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            import torch

            plain, _, _ = load_model(cfg.model_copy(update={"gradient_checkpointing": False}), torch.device("cpu"))
            plain.load_state_dict(sd)
            model = plain
        dist.barrier()
    if rank == 0:
        m = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        m.save_pretrained(out)
        processor.save_pretrained(out)


def train(cfg: SFTConfig, samples=None, progress: bool = True, callback=None) -> dict:
    """Run SFT; returns ``{"steps", "losses", "output_dir"}``. Metrics go to ``output_dir/metrics.jsonl``."""
    import torch
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from paravt_train.data import load_sft, render_messages

    _maybe_init_distributed()
    rank, world = _dist()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if samples is None:
        samples = load_sft(cfg.data, cfg.video_root)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} must divide by the {world} ranks")
    model, processor, use_bf16 = load_model(cfg, device)
    if world > 1:
        model = _shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = max(1, len(samples) // cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total), total)
    step = 0
    latest = _latest_checkpoint(out) if cfg.resume else None
    if latest is not None:
        step = load_checkpoint(latest, model, optimizer, scheduler)
    cache: dict[int, dict] = {}

    def example(i: int) -> dict:
        if i not in cache:
            msgs = render_messages(samples[i].messages, cfg.video_root, cfg.frames)
            cache[i] = build_example(msgs, processor, keep_frames=True)
        return cache[i]

    pad = processor.tokenizer.pad_token_id
    losses = []
    metrics_path = out / "metrics.jsonl"
    bar = tqdm(total=total, initial=step, desc="sft", disable=not progress or rank != 0)
    model.train()
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)
        order = _order(len(samples), cfg.seed, epoch)
        batch_idx = order[pos * cfg.batch_size : (pos + 1) * cfg.batch_size]
        mine = batch_idx[rank::world]
        t0 = time.perf_counter()
        # longest first, so micro-batches hold similar lengths (less padding; the loss is unchanged)
        exs = sorted((example(i) for i in mine), key=lambda e: -len(e["input_ids"]))
        n_tok = torch.tensor(sum(sum(1 for x in e["labels"][1:] if x != -100) for e in exs), dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(n_tok)
        denom = max(1.0, float(n_tok))
        total_loss = 0.0
        optimizer.zero_grad(set_to_none=True)
        for k in range(0, len(exs), cfg.micro_batch_size):
            mb = collate(exs[k : k + cfg.micro_batch_size], pad, processor.image_processor)
            batch = {key: v.to(device) for key, v in mb.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                keep = _vision_keepalive(model, device) if "pixel_values" not in batch and world > 1 else 0.0
                loss_sum, _ = token_loss_sum(model, batch)
                loss = loss_sum / denom + keep
            loss.backward()
            total_loss += float(loss_sum.detach())
        if world > 1:
            t = torch.tensor(total_loss, dtype=torch.float64)
            torch.distributed.all_reduce(t)
            total_loss = float(t)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        step += 1
        mean_loss = total_loss / denom
        losses.append(mean_loss)
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}")
        if rank == 0 and step % cfg.log_every == 0:
            rec = {"step": step, "loss": mean_loss, "lr": scheduler.get_last_lr()[0], "tokens": int(n_tok),
                   "grad_norm": float(grad_norm), "step_time": time.perf_counter() - t0, "epoch": epoch}
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            save_checkpoint(out / f"checkpoint-{step}", model, optimizer, scheduler, step)
        if callback is not None:
            callback(step, mean_loss)
    bar.close()
    if cfg.save_final:
        save_final(model, processor, out / "final", cfg)
    if world > 1:
        torch.distributed.destroy_process_group()
    return {"steps": step, "losses": losses, "output_dir": str(out)}
