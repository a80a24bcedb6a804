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
from paravt_agent.policy.base import Generation, Policy, Sampling, map_images

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

    def encode(self, messages: list[dict], prefix: str = "") -> tuple[dict, list[int]]:
        """Model inputs for ``messages`` + generation prompt, with ``prefix`` appended as tokens.

        Returns ``(inputs, prefix_ids)``; ``inputs["input_ids"]`` ends with ``prefix_ids``.
        """
        import torch

        model, proc = self._load()
        chat, images = to_hf_messages(messages)
        text = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        inputs = proc(text=[text], images=images or None, return_tensors="pt")
        prefix_ids = proc.tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        if prefix_ids:
            extra = torch.tensor([prefix_ids], dtype=inputs["input_ids"].dtype)
            inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
            inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(extra)], dim=1)
            if "mm_token_type_ids" in inputs:
                inputs["mm_token_type_ids"] = torch.cat(
                    [inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1
                )
        return {k: v.to(model.device) for k, v in inputs.items()}, prefix_ids

    def count_tokens(self, messages: list[dict]) -> int:
        inputs, _ = self.encode(messages)
        return int(inputs["input_ids"].shape[1])

    # ------------------------------------------------------------------ generation

    def generate_sync(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> Generation:
        import torch

        t0 = time.perf_counter()
        model, proc = self._load()
        inputs, prefix_ids = self.encode(messages, prefix)
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
        )

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> Generation:
        return await asyncio.to_thread(self.generate_sync, messages, sampling, prefix)
