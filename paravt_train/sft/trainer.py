"""Supervised fine-tuning (the cold start): loss on assistant tokens only, real processor and chat template.

Readable top to bottom: examples → loop. What it does:

* Every sample's messages are rendered by the agent's own prompt code
  (:func:`paravt_train.data.render_messages`), put through the model's chat
  template and processor (frames kept at the protocol's size); labels are the
  assistant turns' tokens (their ``<|im_end|>`` included); system, user and
  tool-response turns are masked, and so is an assistant turn marked
  ``"train": false``.
* Before the model loads, every row is checked against its videos (a crop past
  a video's end, a file that is not a video): a bad row is reported with its
  number, never found hours into training.
* The loss of a global batch is the sum of token losses divided by the number
  of target tokens in the whole global batch (all micro-batches, all ranks); each
  rank's share is multiplied by the world size because FSDP averages gradients,
  so gradient accumulation and data parallelism give the gradient of one big
  batch on one process (loss *and* gradient norm; tested).
* AdamW with linear warmup then cosine decay; full fine-tuning or LoRA (peft);
  gradient checkpointing; bf16 autocast on GPUs.
* A checkpoint every ``save_every`` steps (:mod:`paravt_train.infra.checkpoint`);
  ``resume`` continues exactly. ``export_every`` also writes plain model
  directories of intermediate steps (``OUTPUT_DIR/model-<step>``).
* Under ``torchrun`` the model is sharded with FSDP2 (:mod:`paravt_train.infra.distributed`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from paravt_agent.config import AgentConfig
from paravt_agent.policy.chat import ChatTokenizer, to_chat_messages
from paravt_agent.policy.families import geometry_of_dir, geometry_of_processor
from paravt_train.data import DataError, check_renderable, load_sft, render_messages
from paravt_train.infra import lora
from paravt_train.infra.checkpoint import (
    load_checkpoint,
    prune_checkpoints,
    resume_latest,
    save_checkpoint,
    write_model_dir,
)
from paravt_train.infra.distributed import (
    barrier,
    clip_grad_norm,
    data_order,
    device,
    init_distributed,
    rank_world,
    shard_model,
    train_device,
    with_dummy_image,
    world_scale,
)
from paravt_train.infra.interrupt import GracefulStop
from paravt_train.infra.tracking import MetricsLog
from paravt_train.sft.config import LoraSettings, SFTConfig

__all__ = ["LoraSettings", "SFTConfig", "assistant_labels", "build_example", "collate", "train"]


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

    chat = ChatTokenizer(processor)
    hf_chat, images = to_chat_messages(messages)
    text = processor.apply_chat_template(hf_chat, tokenize=False, add_generation_prompt=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt", **chat.size_kwargs(images))
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


def collate(examples: list[dict], pad_id: int, processor=None) -> dict:
    """Right-pad a micro-batch; images concatenate in order (frames kept by ``build_example`` are
    turned into pixel values here with ``processor``'s image processor, at the frames' own size)."""
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
    chat = ChatTokenizer(processor) if processor is not None else None
    if frames:
        if chat is None:
            raise ValueError("examples keep frames: collate needs the processor")
        if any("pixel_values" in e for e in examples):
            raise ValueError("a micro-batch mixes kept frames and pixel values")
        batch.update(chat.image_inputs(frames))
    pix = [e["pixel_values"] for e in examples if "pixel_values" in e]
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in examples if "image_grid_thw" in e])
    if chat is not None:  # a family that needs mm_token_type_ids gets them, covering its visual tokens exactly
        chat.check_inputs(batch, "SFT's collate")
    return batch


def token_loss_sum(model, batch: dict):
    """Sum of next-token cross-entropies over labelled tokens, and their count."""
    labels = batch.pop("labels")
    out = model(**batch, use_cache=False)
    logits = out.logits[:, :-1].float()
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, int((target != -100).sum())


# --------------------------------------------------------------------------- model


def load_model(cfg: SFTConfig, dev):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(cfg.model)
    use_bf16 = cfg.bf16 == "true" or (cfg.bf16 == "auto" and dev.type == "cuda")
    model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32).to(dev)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora.enabled:
        model = lora.wrap(model, cfg.lora)
    return model, processor, use_bf16


def save_model_dir(model, processor, out: Path, cfg: SFTConfig) -> None:
    """A plain model directory (LoRA merged, full state dict) that `from_pretrained` and the agent load,
    with the agent config of the frame protocol it was trained with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


    rank, world = rank_world()
    if world > 1:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            plain, _, _ = load_model(cfg.model_copy(update={"gradient_checkpointing": False}), torch.device("cpu"))
            plain.load_state_dict(sd)
            model = plain
        barrier()
    if rank == 0:
        m = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        base = AgentConfig.for_model(cfg.model) or AgentConfig()
        write_model_dir(m, processor, out, base.model_copy(update={"frames": cfg.frames}).to_yaml())
    barrier()


# --------------------------------------------------------------------------- the loop


def train(cfg: SFTConfig, samples=None, progress: bool = True, callback=None) -> dict:
    """Run SFT; returns ``{"steps", "losses", "grad_norms", "output_dir"}``. Metrics go to
    ``output_dir/metrics.jsonl``.

    One function on purpose: the training loop's state (model, optimizer, scheduler, data order, the stop
    signal, the resume point) is shared by every step; the pieces that stand alone (rendering, the loss, the
    checkpoints) are their own functions."""
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup


    cuda = train_device(cfg.device, cfg.model)  # by the model's size, as the local backend places it
    init_distributed(cuda=cuda)
    rank, world = rank_world()
    dev = device(cuda)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the frame protocol bound to the model's geometry (its processor's unit and max pixels; a stated factor that
    # contradicts the model is refused here, before anything loads): the frames rendered, trained on and saved
    cfg = cfg.model_copy(update={"frames": cfg.frames.bound_to(geometry_of_dir(cfg.model))})
    if samples is None:
        samples = load_sft(cfg.data, cfg.video_root)
    bad = check_renderable(samples, cfg.video_root)
    if bad:  # before the model loads: a bad row is named now, not hours into training
        shown = "\n".join(f"  row {i}: {why}" for i, why in bad[:10])
        raise DataError(f"{cfg.data}: {len(bad)} rows cannot be rendered (run `paravt-train validate-data`):\n{shown}")
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} must divide by the {world} ranks")
    model, processor, use_bf16 = load_model(cfg, dev)
    cfg = cfg.model_copy(update={"frames": cfg.frames.bound_to(geometry_of_processor(processor))})
    if world > 1:
        model = shard_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = max(1, len(samples) // cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total), total)
    step = 0
    resumed = resume_latest(out, lambda p: load_checkpoint(p, model, optimizer, scheduler)) if cfg.resume else None
    if resumed is not None:
        step = resumed[1]
    cache: dict[int, dict] = {}

    def example(i: int) -> dict:
        if i not in cache:
            msgs = render_messages(samples[i].messages, cfg.video_root, cfg.frames)
            cache[i] = build_example(msgs, processor, keep_frames=True)
        return cache[i]

    pad = processor.tokenizer.pad_token_id
    chat = ChatTokenizer(processor)
    losses, norms = [], []
    metrics = MetricsLog(out, cfg.report_to, cfg.model_dump(mode="json"), rank=rank).start(step)
    bar = tqdm(total=total, initial=step, desc="sft", disable=not progress or rank != 0)
    stopped = None
    with GracefulStop() as stop:
        model.train()
        while step < total:
            epoch, pos = divmod(step, steps_per_epoch)
            order = data_order(len(samples), cfg.seed, epoch)
            batch_idx = order[pos * cfg.batch_size : (pos + 1) * cfg.batch_size]
            mine = batch_idx[rank::world]
            t0 = time.perf_counter()
            # longest first, so micro-batches hold similar lengths (less padding; the loss is unchanged)
            exs = sorted((example(i) for i in mine), key=lambda e: -len(e["input_ids"]))
            n_tok = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in exs)
            denom = max(1.0, _global_sum(float(n_tok), world))
            total_loss = 0.0
            optimizer.zero_grad(set_to_none=True)
            for k in range(0, len(exs), cfg.micro_batch_size):
                mb = collate(exs[k : k + cfg.micro_batch_size], pad, processor)
                if world > 1 and "pixel_values" not in mb:  # the vision tower's collectives run on every rank
                    mb = with_dummy_image(mb, chat)
                batch = {key: v.to(dev) for key, v in mb.items()}
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                    loss_sum, _ = token_loss_sum(model, batch)
                    # this rank's share of the global mean, times the world size: FSDP averages gradients
                    loss = loss_sum / denom * world_scale()
                loss.backward()
                total_loss += float(loss_sum.detach())
            total_loss = _global_sum(total_loss, world)
            grad_norm = clip_grad_norm(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            mean_loss = total_loss / denom
            losses.append(mean_loss)
            norms.append(grad_norm)
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            if rank == 0 and step % cfg.log_every == 0:
                rec = {"step": step, "loss": mean_loss, "lr": scheduler.get_last_lr()[0], "tokens": int(denom),
                       "grad_norm": grad_norm, "step_time": time.perf_counter() - t0, "epoch": epoch}
                metrics.log(rec)
            saved = False
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                save_checkpoint(out / f"checkpoint-{step}", model, optimizer, scheduler, step)
                saved = True
                if cfg.keep_checkpoints:
                    prune_checkpoints(out, cfg.keep_checkpoints)
            if cfg.export_every and step % cfg.export_every == 0 and step < total:
                save_model_dir(model, processor, out / f"model-{step}", cfg)
            if callback is not None:
                callback(step, mean_loss)
            if step < total and stop.requested():  # SIGTERM: this step is kept, the run ends here
                if not saved:
                    save_checkpoint(out / f"checkpoint-{step}", model, optimizer, scheduler, step)
                    if cfg.keep_checkpoints:
                        prune_checkpoints(out, cfg.keep_checkpoints)
                stopped = stop.signal_name
                break
        bar.close()
    metrics.close()
    if stopped:
        if rank == 0:
            print(f"stopped by {stopped} after step {step}: {out / f'checkpoint-{step}'} holds it; run again with "
                  "resume: true (the default) to continue", flush=True)
    elif cfg.save_final:
        save_model_dir(model, processor, out / "final", cfg)
    if world > 1:
        torch.distributed.destroy_process_group()
    return {"steps": step, "losses": losses, "grad_norms": norms, "output_dir": str(out), "stopped": stopped}


def _global_sum(value: float, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor(value, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t)
