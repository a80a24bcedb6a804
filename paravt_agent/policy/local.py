"""``local``: an in-process ``transformers`` vision-language model (Qwen3-VL / Qwen2.5-VL families).

Token-in/token-out: the prompt is tokenised once by the model's own processor
and chat template, the forced prefix (the think prefix) is appended as tokens,
and the sampled token ids come back with their log-probabilities, so training
never re-tokenises model output.

Calls are serialised on one lock (one model, one forward at a time) and run in a
worker thread, so concurrent ``generate`` calls from the agent graph are safe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import (
    Generation,
    Policy,
    Sampling,
    continuation_text,
    continued_ids,
    last_token_turn,
    map_images,
)

__all__ = ["LocalPolicy", "to_hf_messages"]


def to_hf_messages(messages: list[dict]) -> tuple[list[dict], list]:
    """Neutral messages -> (chat-template messages, PIL images in order)."""
    from PIL import Image

    images = []

    def part(img):
        images.append(img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img, np.uint8)))
        return {"type": "image"}

    return map_images(messages, part), images


class LocalPolicy(Policy):
    """A model directory loaded with ``AutoModelForImageTextToText`` + ``AutoProcessor``."""

    name = "local"

    def __init__(self, model: str | Path, device: str = "auto", dtype: str = "auto", model_obj=None, processor=None):
        self.path = str(model)
        if model_obj is None and not Path(self.path).is_dir():
            raise PolicyError(
                f"model directory {self.path} does not exist; build the toy policy with `paravt-train toy` "
                "or pass a local Qwen3-VL / Qwen2.5-VL directory"
            )
        self.device = device
        self.dtype = dtype
        self._model, self._processor = model_obj, processor
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    # ------------------------------------------------------------------ loading

    def _load(self):
        with self._load_lock:
            if self._model is not None and self._processor is not None:
                return self._model, self._processor
            import torch
            from transformers import AutoModelForImageTextToText, AutoProcessor

            device = self.device
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if self.dtype == "auto":
                dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
            else:
                dtype = getattr(torch, self.dtype)
            try:
                if self._processor is None:
                    self._processor = AutoProcessor.from_pretrained(self.path)
                if self._model is None:
                    self._model = AutoModelForImageTextToText.from_pretrained(self.path, dtype=dtype).to(device)
                    self._model.eval()
            except OSError as exc:
                raise PolicyError(f"cannot load a model from {self.path}: {exc}") from exc
            return self._model, self._processor

    @property
    def model(self):
        return self._load()[0]

    @property
    def processor(self):
        return self._load()[1]

    @property
    def eos_id(self) -> int:
        tok = self.processor.tokenizer
        return tok.convert_tokens_to_ids("<|im_end|>")

    # ------------------------------------------------------------------ encoding

    def _render(self, chat: list[dict], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode(self, messages: list[dict], prefix: str = "") -> tuple[dict, list[int]]:
        """Model inputs for ``messages`` + generation prompt, with ``prefix`` appended as tokens.

        When an assistant message carries its Generation (the graph puts it there), the prompt is
        that turn's exact token ids continued by the tokens of the messages after it: model output
        is never decoded and re-encoded. Returns ``(inputs, prefix_ids)``; ``inputs["input_ids"]``
        ends with ``prefix_ids``; ``inputs["images"]`` are the prompt's images in order and
        ``inputs["retokenized"]`` says whether a full re-render was needed (a template that is not
        prefix-stable).
        """
        import torch

        model, proc = self._load()
        chat, images = to_hf_messages(messages)
        k, prev = last_token_turn(messages)
        tail = continuation_text(self._render, chat, k) if prev is not None else None
        pixel, grid = [], []
        if tail is None:
            enc = proc(text=[self._render(chat, True)], images=images or None, return_tensors="pt")
            ids = enc["input_ids"][0].tolist()
        else:
            before = sum(1 for m in messages[: k + 1] if not isinstance(m["content"], str)
                         for p in m["content"] if p["type"] == "image")
            if before:
                old = proc.image_processor(images=images[:before], return_tensors="pt")
                pixel.append(old["pixel_values"])
                grid.append(old["image_grid_thw"])
            enc = proc(text=[tail], images=images[before:] or None, return_tensors="pt")
            ids = continued_ids(prev, self.eos_id) + enc["input_ids"][0].tolist()
        if "pixel_values" in enc:
            pixel.append(enc["pixel_values"])
            grid.append(enc["image_grid_thw"])
        prefix_ids = proc.tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        ids = ids + list(prefix_ids)
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        if pixel:
            inputs["pixel_values"] = torch.cat(pixel)
            inputs["image_grid_thw"] = torch.cat(grid)
        if "mm_token_type_ids" in enc:
            inputs["mm_token_type_ids"] = self.mm_token_types(inputs["input_ids"])
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        inputs["images"], inputs["retokenized"] = images, prev is not None and tail is None
        return inputs, list(prefix_ids)

    def mm_token_types(self, input_ids):
        """Qwen3-VL's ``mm_token_type_ids``: 1 on image placeholder tokens, 0 elsewhere."""
        image_id = self.processor.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        return (input_ids == image_id).long()

    def image_inputs(self, images: list) -> dict:
        """``pixel_values`` and ``image_grid_thw`` of a list of images (what a forward pass needs)."""
        if not images:
            return {}
        out = self.processor.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def count_tokens(self, messages: list[dict]) -> int:
        inputs, _ = self.encode(messages)
        return int(inputs["input_ids"].shape[1])

    # ------------------------------------------------------------------ generation

    def generate_sync(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> Generation:
        import torch

        t0 = time.perf_counter()
        model, proc = self._load()
        inputs, prefix_ids = self.encode(messages, prefix)
        images, retokenized = inputs.pop("images"), inputs.pop("retokenized")
        n_prompt = int(inputs["input_ids"].shape[1])
        greedy = sampling.temperature <= 0
        kw = dict(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            eos_token_id=self.eos_id,
            pad_token_id=proc.tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if not greedy:
            kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        if sampling.stop:
            kw.update(stop_strings=list(sampling.stop), tokenizer=proc.tokenizer)
        with self._lock, torch.inference_mode():
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            out = model.generate(**inputs, **kw)
        ids = out.sequences[0, n_prompt:].tolist()
        temp = sampling.temperature if not greedy else 1.0
        logits = torch.stack(out.logits, dim=1)[0].float() / temp  # (new, vocab), before top-p/top-k
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids, device=logits.device)[:, None])
        logprobs = logprobs[:, 0].tolist()
        pad = proc.tokenizer.pad_token_id
        while ids and ids[-1] == pad and pad != self.eos_id:  # right padding after eos, if any
            ids.pop()
            logprobs.pop()
        stopped = bool(ids) and ids[-1] == self.eos_id
        body = ids[:-1] if stopped else ids
        text = prefix + proc.tokenizer.decode(body, skip_special_tokens=False)
        prompt_ids = inputs["input_ids"][0, : n_prompt - len(prefix_ids)].tolist()
        return Generation(
            text=text, prefix=prefix, finish_reason="stop" if stopped else "length",
            prompt_tokens=n_prompt, completion_tokens=len(ids), latency=time.perf_counter() - t0,
            prompt_ids=prompt_ids, prefix_ids=list(prefix_ids), output_ids=ids, logprobs=logprobs,
            extra={"images": images, "retokenized": retokenized, "temperature": temp},
        )

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> Generation:
        return await asyncio.to_thread(self.generate_sync, messages, sampling, prefix)
