"""``local``: an in-process ``transformers`` VLM (the Qwen3-VL, Qwen2.5-VL, Qwen2-VL families: ``policy.families``).

Token-in/token-out: the prompt is tokenised once by the model's own processor
and chat template, the forced prefix (the think prefix) is appended as tokens,
and the sampled token ids come back with their log-probabilities, so training
never re-tokenises model output.

Concurrent ``generate`` calls (the K sub-agents of a turn, the G rollouts of a
prompt) are batched: a worker thread takes every pending request that shares
``max_new_tokens`` and stop strings, up to ``max_batch``, and runs them as one
left-padded ``generate`` call. On 2 CPU cores a batch of 8 produces about four
times the tokens per second of one request. Each row samples with its own
temperature, top-p/top-k and seed (:class:`RowSampler`), and gets its own token
ids and logprobs back. Model calls hold one lock, so direct ``generate_sync``
calls from other threads are safe too.

Device and dtype (:mod:`paravt_agent.policy.placement`): ``auto`` runs a model on the GPU when one is present and
the model has 64 MiB of weights or more (bfloat16 there), else on the CPU in float32: a smaller model (the toy
policy) decodes faster on the CPU, where a step is not bound by kernel launches. A decoding step makes no host
sync of its own (the sampler keeps its work on the device).

Fairness: the rows of a batch are within ``length_ratio`` (4) of each other's
prompt length and hold at most ``max_batch_tokens`` padded prompt tokens (rows ×
the longest row), so one long prompt never pads short ones; when the oldest
request is long (``long_prompt_tokens`` or more) the short ones waiting beside it
go first, for at most ``long_patience`` batches. A caller that is cancelled (its
deadline passed, its client went away) leaves the batch at the next decoding step:
its row stops, and a batch whose rows are all cancelled ends at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import numpy as np

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import Policy, images_of, model_type_of_dir, text_of
from paravt_agent.policy.batcher import (
    QueuedBatcher,
    RowSampler,
    batch_key,
    cancelled_rows,
    scored_distribution,
)
from paravt_agent.policy.chat import ChatTokenizer, EncodedPrompt, ban, file_token_count
from paravt_agent.policy.families import geometry_of_dir, geometry_of_processor
from paravt_agent.policy.placement import patch_embed_as_matmul, resolve_device, resolve_dtype
from paravt_agent.policy.reuse import PrefixCache, VisionCache, feature_slice, image_keys
from paravt_agent.types import Continuation, Generation, Sampling
from paravt_agent.video.geometry import FrameGeometry

__all__ = ["LocalPolicy", "RowSampler", "cache_argument", "cache_of"]


class LocalPolicy(Policy):
    """A model directory loaded with ``AutoModelForImageTextToText`` + ``AutoProcessor``."""

    name = "local"
    returns_tokens = True
    reports_service = True  # the batcher marks a request served when it takes it into a batch

    def __init__(self, model: str | Path, device: str = "auto", dtype: str = "auto", model_obj=None, processor=None,
                 max_batch: int = 8, batch_wait: float = 0.005, reuse: bool = True, vision_cache_mb: int = 256,
                 prefix_cache_mb: int = 256, max_batch_tokens: int = 32768, length_ratio: float = 4.0,
                 long_prompt_tokens: int = 2048, long_patience: int = 4, autocast=None):
        self.path = str(model)
        # a torch dtype to generate under autocast in (an in-process trainer's bf16 autocast: the rollouts then come
        # from the numerics the trainer scores them with); None: the weights' own dtype
        self.autocast = autocast
        # shared prompt work (paravt_agent.policy.reuse): vision features per distinct frame, KV of prefixes
        self.reuse = reuse
        self.vision_cache = VisionCache(vision_cache_mb << 20)
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20)
        # the queue that turns concurrent calls into batches: an object this backend holds, given its encoder and
        # its batch runner (settings adjustable on it: ``policy.batcher.max_batch``)
        self.batcher = QueuedBatcher(self.encode, self._run_rows, max_batch=max_batch, batch_wait=batch_wait,
                                     max_batch_tokens=max_batch_tokens, length_ratio=length_ratio,
                                     long_prompt_tokens=long_prompt_tokens, long_patience=long_patience)
        if model_obj is None and not Path(self.path).is_dir():
            raise PolicyError(
                f"model directory {self.path} does not exist; build the toy policy with `paravt-train toy` "
                "or pass a local Qwen3-VL / Qwen2.5-VL / Qwen2-VL directory"
            )
        self.device = device
        self.dtype = dtype
        self._model, self._processor = model_obj, processor
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._chat: ChatTokenizer | None = None

    # ------------------------------------------------------------------ loading

    def _load(self):
        with self._load_lock:
            if self._model is not None and self._processor is not None:
                return self._model, self._processor
            from transformers import AutoModelForImageTextToText, AutoProcessor
            from transformers.utils import logging as hf_logging

            bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # no "Loading weights" bar on every CLI call
            try:
                if self._processor is None:
                    self._processor = AutoProcessor.from_pretrained(self.path)
                if self._model is None:
                    device = resolve_device(self.device, self.path)  # auto: a small model stays on the CPU
                    model = AutoModelForImageTextToText.from_pretrained(self.path, dtype=resolve_dtype(self.dtype,
                                                                                                       device))
                    patch_embed_as_matmul(model)  # a model it loads itself (a trainer's model is left as it is)
                    self._model = model.to(device).eval()
            except OSError as exc:
                raise PolicyError(f"cannot load a model from {self.path}: {exc}") from exc
            finally:
                if bars:
                    hf_logging.enable_progress_bar()
            return self._model, self._processor

    @property
    def model(self):
        return self._load()[0]

    @property
    def processor(self):
        return self._load()[1]

    @property
    def chat(self) -> ChatTokenizer:
        if self._chat is None:
            self._chat = ChatTokenizer(self.processor, self.model_type)
        return self._chat

    @property
    def frame_geometry(self) -> FrameGeometry | None:
        """The model's processor's geometry: the processor this policy was given, else the directory's files (no model
        loaded for it)."""
        if self._processor is not None:
            return geometry_of_processor(self._processor, self.model_type, f"the processor of {self.path}")
        return geometry_of_dir(self.path)

    @property
    def model_type(self) -> str | None:
        if self._model is not None:
            return getattr(self._model.config, "model_type", None)
        return model_type_of_dir(self.path)  # without loading the model

    def generates_with(self, model) -> bool:
        return self._model is model

    @property
    def eos_id(self) -> int:
        return self.chat.eos_id

    # ------------------------------------------------------------------ encoding

    def encode(self, messages: list[dict], prefix: str = "", continuation: Continuation | None = None
               ) -> EncodedPrompt:
        """The prompt's tokens (continuing ``continuation``'s exact ids), ``prefix`` appended as tokens."""
        self._load()
        self.chat.remember = self.reuse  # image-processor outputs remembered by frame bytes
        return self.chat.encode(messages, prefix, continuation)

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.encode(messages).ids)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        return tuple(self.chat.placeholder_ids)

    def count_text_tokens(self, text: str) -> int:
        n = file_token_count(self.path, text) if self._chat is None else None  # an input check: no model loads
        if n is not None:
            return n
        self._load()
        return len(self.chat.tokens(text))

    def prompt_token_bound(self, messages: list[dict]) -> int:
        """An upper bound of the prompt's length without encoding it: every text byte a token, a frame its
        patch grid (rounded up) plus its two markers, and the chat template's framing per message."""
        import math


        self._load()
        unit = self.chat.unit
        text = sum(len(text_of(m["content"]).encode("utf-8", "replace")) + 16 for m in messages)
        frames = sum(math.ceil(f.shape[0] / unit) * math.ceil(f.shape[1] / unit) + 2
                     for f in (np.asarray(i) for i in images_of(messages)))
        return text + frames + 64

    @property
    def context_length(self) -> int | None:
        cfg = self.model.config
        return getattr(getattr(cfg, "text_config", None) or cfg, "max_position_embeddings", None)

    # ------------------------------------------------------------------ generation

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None, role: str = "planner") -> Generation:
        """Queued (:class:`~paravt_agent.policy.batcher.QueuedBatcher`): concurrent calls that arrive together run
        as one batch (up to ``max_batch`` rows and ``max_batch_tokens`` padded prompt tokens). Cancelling the call
        stops its row at the next step."""
        return await self.batcher.generate(messages, sampling, prefix, continuation)

    def generate_sync(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                      continuation: Continuation | None = None) -> Generation:
        """One request, run at once in the calling thread."""
        return self.generate_batch([(messages, sampling, prefix, continuation)])[0]

    def generate_batch(self, requests: list[tuple], return_exceptions: bool = False) -> list[Generation | Exception]:
        """Several requests as ONE left-padded ``generate`` call (they must share ``max_new_tokens`` and
        ``stop``). Each row keeps its own temperature, top-p/top-k and seed (:class:`RowSampler`), so a
        row samples the same tokens whatever else is in the batch (up to float rounding of padding).
        With ``return_exceptions`` a request that cannot be encoded gets its exception in its place
        and the others still run."""
        if not requests:
            return []
        requests = [(*r, None) if len(r) == 3 else tuple(r) for r in requests]
        keys = {batch_key(r[1]) for r in requests}
        if len(keys) > 1:
            raise ValueError("requests in one batch must share max_new_tokens and stop strings")
        results: list = [None] * len(requests)
        rows, where = [], []
        for i, (m, s, prefix, cont) in enumerate(requests):
            try:
                rows.append((self.encode(m, prefix, cont), s, prefix))
                where.append(i)
            except Exception as exc:  # handed back to that request's caller
                if not return_exceptions:
                    raise
                results[i] = exc
        for i, g in zip(where, self._run_rows(rows) if rows else [], strict=True):
            results[i] = g
        return results

    def _run_rows(self, rows: list[tuple[EncodedPrompt, Sampling, str]],
                  cancelled: list[threading.Event] | None = None) -> list[Generation | Exception]:
        import torch
        from transformers import LogitsProcessorList, StoppingCriteriaList

        t0 = time.perf_counter()
        model, proc = self._load()
        chat = self.chat
        width = max(len(enc.ids) for enc, *_ in rows)
        pad = chat.pad_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        pixel, grid = [], []
        for i, (enc, *_rest) in enumerate(rows):
            n = len(enc.ids)
            ids[i, width - n:] = torch.tensor(enc.ids)  # left padding: every row ends where generation starts
            att[i, width - n:] = 1
            if enc.pixel_values is not None:
                pixel.append(enc.pixel_values)
                grid.append(torch.tensor(enc.image_grid_thw))
        keys = [image_keys(enc.pixel_values, enc.image_grid_thw) if self.reuse and enc.pixel_values is not None
                else [] for enc, *_ in rows]
        inputs = {"input_ids": ids, "attention_mask": att}
        if pixel:
            inputs["pixel_values"] = torch.cat(pixel)
            inputs["image_grid_thw"] = torch.cat(grid)
        if chat.uses_mm_token_types:
            inputs["mm_token_type_ids"] = chat.mm_token_types(ids)
        chat.check_inputs(inputs, "the local backend's batch")
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        first = rows[0][1]
        sampler = RowSampler([s for _, s, _ in rows], banned=chat.placeholder_ids)
        kw = dict(max_new_tokens=first.max_new_tokens, do_sample=False, eos_token_id=self.eos_id, pad_token_id=pad,
                  output_logits=True, return_dict_in_generate=True, logits_processor=LogitsProcessorList([sampler]))
        if first.stop:
            kw.update(stop_strings=list(first.stop), tokenizer=proc.tokenizer)
        if cancelled:
            kw["stopping_criteria"] = StoppingCriteriaList([cancelled_rows(cancelled)])
        reuse = self.reuse and self._reusable(model)
        autocast = (torch.autocast(model.device.type, dtype=self.autocast) if self.autocast is not None
                    else contextlib.nullcontext())
        with self._lock, torch.inference_mode(), autocast:
            t_gen = time.perf_counter()
            if reuse:
                self.prefix_cache.check_version(model)
                inputs = self._shared_work(model, rows, keys, inputs)
            with scored_distribution(model):
                out = model.generate(**inputs, **kw)
            t_end = time.perf_counter()
            if reuse:
                self._store_prefixes(model, rows, keys, out, width)
        logits = torch.stack(out.logits, dim=1).float()  # (B, new, vocab): raw, before the sampler
        latency = time.perf_counter() - t0
        t_first = sampler.first_call or t_end
        timings = {"encode": round(t_gen - t0, 6), "prefill": round(t_first - t_gen, 6),
                   "decode": round(t_end - t_first, 6)}
        return [PolicyError("the request was cancelled (its deadline passed or its caller went away)")
                if cancelled and cancelled[i].is_set() else
                self._generation(enc, s, prefix, out.sequences[i, width:].tolist(), logits[i], latency, timings,
                                 len(rows))
                for i, (enc, s, prefix) in enumerate(rows)]

    def _generation(self, enc: EncodedPrompt, s: Sampling, prefix: str, new: list[int], logits, latency: float,
                    timings: dict, batch_size: int) -> Generation:
        """One row's result: its own tokens (the batch's padding after its end dropped), their logprobs under the
        distribution it sampled from, its text."""
        import torch

        chat = self.chat
        if self.eos_id in new:  # the row's own end; the batch pads finished rows after it
            new = new[: new.index(self.eos_id) + 1]
        while new and new[-1] == chat.pad_id != self.eos_id:  # a row ended by a stop string, padded after it
            new.pop()
        temp = s.temperature if s.temperature > 0 else 1.0
        # scored as sampled: the sampler's ban (vision placeholders) applies to the logprobs too
        lp = torch.log_softmax(ban(logits[: len(new)].float(), chat.placeholder_ids) / temp, dim=-1)
        logprobs = lp.gather(1, torch.tensor(new, device=lp.device)[:, None])[:, 0].tolist() if new else []
        stopped = bool(new) and new[-1] == self.eos_id
        body = new[:-1] if stopped else new
        text = prefix + self.processor.tokenizer.decode(body, skip_special_tokens=False)
        stopped = stopped or any(x in text[len(prefix):] for x in s.stop)
        return Generation(
            text=text, prefix=prefix, finish_reason="stop" if stopped else "length",
            prompt_tokens=len(enc.ids), completion_tokens=len(new), latency=latency,
            prompt_ids=enc.prompt_ids, prefix_ids=list(enc.prefix_ids), output_ids=new, logprobs=logprobs,
            logprob_temperature=temp, image_grid_thw=list(enc.image_grid_thw), retokenized=enc.retokenized,
            batch_size=batch_size, timings=dict(timings),
        )

    # ------------------------------------------------------------------ shared prompt work

    @staticmethod
    def _reusable(model) -> bool:
        """Models whose forward takes precomputed vision features (``mm_encoder_outputs``) and a KV cache."""
        import inspect

        return "mm_encoder_outputs" in inspect.signature(model.forward).parameters and hasattr(model, "model")

    def _shared_work(self, model, rows, keys, inputs: dict) -> dict:
        """``generate``'s inputs with the shared work done once.

        Vision features come from :class:`VisionCache` (each distinct frame through the tower once).
        Where rows repeat a prompt (the G rollouts) or continue a stored sequence (:class:`PrefixCache`:
        a planner turn after its tool turn), each distinct prompt's KV is computed once at batch 1 (the
        stored part reused, only the new tokens prefilled), left-padded into one batch cache, and
        ``generate`` feeds only the last prompt token of every row."""
        import torch
        from transformers import DynamicCache

        plain = {k: v for k, v in inputs.items() if k != "pixel_values"}
        name = cache_argument(model)
        groups: dict[tuple, list[int]] = {}
        for i, ((enc, *_), k) in enumerate(zip(rows, keys, strict=True)):
            groups.setdefault((tuple(enc.ids), tuple(k)), []).append(i)
        entries = {}
        for g in groups:
            enc_ids, k = list(g[0]), list(g[1])
            e = self.prefix_cache.lookup(enc_ids, k)
            if e is not None and len(k) == len(e.images):  # no new frames after the stored part
                entries[g] = e
        if not entries and len(groups) == len(rows):  # nothing shared: one batched prefill, cached vision
            if "pixel_values" not in inputs:
                return inputs
            mm = self.vision_cache.features(model, [(enc.pixel_values, list(enc.image_grid_thw), k)
                                                    for (enc, *_), k in zip(rows, keys, strict=True)])
            return {**plain, "mm_encoder_outputs": mm}
        fresh = [g for g in groups if g not in entries]
        mm_rows = [(rows[groups[g][0]][0].pixel_values, list(rows[groups[g][0]][0].image_grid_thw), list(g[1]))
                   for g in fresh if g[1]]
        mm = self.vision_cache.features(model, mm_rows) if mm_rows else None
        width = inputs["input_ids"].shape[1]
        per_group: dict[tuple, tuple[list, object]] = {}
        img_at = 0
        for g in groups:
            ids = torch.tensor([list(g[0])], device=model.device)
            n = ids.shape[1]
            cache = DynamicCache(config=model.config)
            if g in entries:
                e = entries[g]
                for li, (k, v) in enumerate(e.layers):
                    cache.update(k.clone(), v.clone(), li)
                model.model.rope_deltas = e.rope_deltas
                if len(e.ids) < n - 1:  # the new tokens after the stored part (text: positions continue)
                    model(input_ids=ids[:, len(e.ids):n - 1], **{name: cache}, use_cache=True, logits_to_keep=1)
                deltas = e.rope_deltas
            else:
                one = {"input_ids": ids[:, :n - 1], "attention_mask": torch.ones_like(ids[:, :n - 1])}
                if "mm_token_type_ids" in inputs:
                    one["mm_token_type_ids"] = self.chat.mm_token_types(ids[:, :n - 1].cpu()).to(model.device)
                if g[1]:
                    count = len(g[1])
                    one["mm_encoder_outputs"] = feature_slice(mm, img_at, count)
                    grid = rows[groups[g][0]][0].image_grid_thw
                    one["image_grid_thw"] = torch.tensor(list(grid), device=model.device)
                    img_at += count
                model.model.rope_deltas = None
                model(**one, **{name: cache}, use_cache=True, logits_to_keep=1)
                deltas = model.model.rope_deltas
            if deltas is None:
                deltas = torch.zeros((1, 1), dtype=torch.long, device=model.device)
            per_group[g] = ([(layer.keys, layer.values) for layer in cache.layers], deltas.reshape(1, 1))
        # one batch cache: row i holds its prompt's KV, left-padded to the batch width minus the last token
        order = [next(g for g, m in groups.items() if i in m) for i in range(len(rows))]
        batch = DynamicCache(config=model.config)
        for li in range(len(per_group[order[0]][0])):
            ks, vs = [], []
            for g in order:
                k, v = per_group[g][0][li]
                pad = width - 1 - k.shape[-2]
                if pad:
                    k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                    v = torch.nn.functional.pad(v, (0, 0, pad, 0))
                ks.append(k)
                vs.append(v)
            batch.update(torch.cat(ks), torch.cat(vs), li)
        model.model.rope_deltas = torch.cat([per_group[g][1] for g in order])
        return {**plain, name: batch}

    def _store_prefixes(self, model, rows, keys, out, width: int) -> None:
        """Each row's whole sequence (prompt + its own tokens, no padding) into :class:`PrefixCache`, for a
        turn that continues it."""
        cache = cache_of(out)
        deltas = model.model.rope_deltas
        if cache is None or not hasattr(cache, "layers") or deltas is None:
            return
        filled = cache.layers[0].keys.shape[-2]
        for i, (enc, *_rest) in enumerate(rows):
            new = out.sequences[i, width:].tolist()
            if self.eos_id in new:
                new = new[: new.index(self.eos_id) + 1]
            seq = [*enc.ids, *new]
            off = width - len(enc.ids)  # left padding of this row
            n = min(len(seq) - 1, filled - off)  # the last token was never fed back
            layers = [(layer.keys[i:i + 1, :, off:off + n].clone(), layer.values[i:i + 1, :, off:off + n].clone())
                      for layer in cache.layers]
            row_delta = deltas[i:i + 1] if deltas.shape[0] == len(rows) else deltas[:1]
            self.prefix_cache.put(seq[:n], keys[i], layers, row_delta.clone())

def cache_argument(model) -> str:
    """The name the installed transformers gives the KV-cache argument of ``forward`` and ``generate``:
    ``cache`` (5.24+, where ``past_key_values`` is deprecated for removal) or ``past_key_values`` (before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a ``forward`` / ``generate`` output carries, under either name (read without touching a
    deprecated attribute)."""
    for key in ("cache", "past_key_values"):
        if key in output:  # a ModelOutput holds its non-None fields as keys
            return output[key]
    return None
