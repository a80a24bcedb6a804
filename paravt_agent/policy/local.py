"""``local``: an in-process ``transformers`` vision-language model (Qwen3-VL / Qwen2.5-VL families).

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

Fairness: the rows of a batch are within ``length_ratio`` (4) of each other's
prompt length and hold at most ``max_batch_tokens`` padded prompt tokens (rows ×
the longest row), so one long prompt never pads short ones; when the oldest
request is long (``long_prompt_tokens`` or more) the short ones waiting beside it
go first, for at most ``long_patience`` batches. A caller that is cancelled (its
deadline passed, its client went away) leaves the batch at the next decoding step:
its row stops, and a batch whose rows are all cancelled ends at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import Policy
from paravt_agent.policy.chat import ChatTokenizer, EncodedPrompt
from paravt_agent.policy.reuse import PrefixCache, VisionCache, image_keys
from paravt_agent.types import Continuation, Generation, Sampling

__all__ = ["LocalPolicy", "RowSampler", "cache_argument", "cache_of"]


class LocalPolicy(Policy):
    """A model directory loaded with ``AutoModelForImageTextToText`` + ``AutoProcessor``."""

    name = "local"
    returns_tokens = True

    def __init__(self, model: str | Path, device: str = "auto", dtype: str = "auto", model_obj=None, processor=None,
                 max_batch: int = 8, batch_wait: float = 0.005, reuse: bool = True, vision_cache_mb: int = 256,
                 prefix_cache_mb: int = 256, max_batch_tokens: int = 32768, length_ratio: float = 4.0,
                 long_prompt_tokens: int = 2048, long_patience: int = 4):
        self.path = str(model)
        # shared prompt work (paravt_agent.policy.reuse): vision features per distinct frame, KV of prefixes
        self.reuse = reuse
        self.vision_cache = VisionCache(vision_cache_mb << 20)
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20)
        self.max_batch = max_batch
        self.batch_wait = batch_wait
        self.max_batch_tokens = max_batch_tokens
        self.length_ratio = length_ratio
        self.long_prompt_tokens = long_prompt_tokens
        self.long_patience = long_patience
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._worker: threading.Thread | None = None
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
        self._chat: ChatTokenizer | None = None

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
            from transformers.utils import logging as hf_logging

            bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # no "Loading weights" bar on every CLI call
            try:
                if self._processor is None:
                    self._processor = AutoProcessor.from_pretrained(self.path)
                if self._model is None:
                    self._model = AutoModelForImageTextToText.from_pretrained(self.path, dtype=dtype).to(device)
                    self._model.eval()
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
            self._chat = ChatTokenizer(self.processor)
        return self._chat

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

    def count_text_tokens(self, text: str) -> int:
        self._load()
        return len(self.chat.tokens(text))

    def prompt_token_bound(self, messages: list[dict]) -> int:
        """An upper bound of the prompt's length without encoding it: every text byte a token, a frame its
        patch grid (rounded up) plus its two markers, and the chat template's framing per message."""
        import math

        from paravt_agent.policy.base import images_of, text_of

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
        keys = {_batch_key(r[1]) for r in requests}
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
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        first = rows[0][1]
        sampler = RowSampler([s for _, s, _ in rows], banned=chat.placeholder_ids)
        kw = dict(max_new_tokens=first.max_new_tokens, do_sample=False, eos_token_id=self.eos_id, pad_token_id=pad,
                  output_logits=True, return_dict_in_generate=True, logits_processor=LogitsProcessorList([sampler]))
        if first.stop:
            kw.update(stop_strings=list(first.stop), tokenizer=proc.tokenizer)
        if cancelled:
            kw["stopping_criteria"] = StoppingCriteriaList([_Cancelled(cancelled)])
        reuse = self.reuse and self._reusable(model)
        with self._lock, torch.inference_mode():
            t_gen = time.perf_counter()
            if reuse:
                self.prefix_cache.check_version(model)
                inputs = self._shared_work(model, rows, keys, inputs)
            with _scored_distribution(model):
                out = model.generate(**inputs, **kw)
            t_end = time.perf_counter()
            if reuse:
                self._store_prefixes(model, rows, keys, out, width)
        logits = torch.stack(out.logits, dim=1).float()  # (B, new, vocab): raw, before the sampler
        latency = time.perf_counter() - t0
        t_first = sampler.first_call or t_end
        timings = {"encode": round(t_gen - t0, 6), "prefill": round(t_first - t_gen, 6),
                   "decode": round(t_end - t_first, 6)}
        gens: list[Generation | Exception] = []
        for i, (enc, s, prefix) in enumerate(rows):
            if cancelled and cancelled[i].is_set():
                gens.append(PolicyError("the request was cancelled (its deadline passed or its caller went away)"))
                continue
            n_prompt = len(enc.ids)
            new = out.sequences[i, width:].tolist()
            if self.eos_id in new:  # the row's own end; the batch pads finished rows after it
                new = new[: new.index(self.eos_id) + 1]
            while new and new[-1] == pad != self.eos_id:  # a row ended by a stop string, padded after it
                new.pop()
            temp = s.temperature if s.temperature > 0 else 1.0
            lp = torch.log_softmax(logits[i, : len(new)] / temp, dim=-1)
            logprobs = lp.gather(1, torch.tensor(new, device=lp.device)[:, None])[:, 0].tolist() if new else []
            stopped = bool(new) and new[-1] == self.eos_id
            body = new[:-1] if stopped else new
            text = prefix + proc.tokenizer.decode(body, skip_special_tokens=False)
            stopped = stopped or any(x in text[len(prefix):] for x in s.stop)
            gens.append(Generation(
                text=text, prefix=prefix, finish_reason="stop" if stopped else "length",
                prompt_tokens=n_prompt, completion_tokens=len(new), latency=latency,
                prompt_ids=enc.prompt_ids, prefix_ids=list(enc.prefix_ids), output_ids=new, logprobs=logprobs,
                logprob_temperature=temp, image_grid_thw=list(enc.image_grid_thw), retokenized=enc.retokenized,
                batch_size=len(rows), timings=dict(timings),
            ))
        return gens

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
                    one["mm_encoder_outputs"] = _images(mm, img_at, count)
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

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None) -> Generation:
        """Queued: concurrent calls that arrive together run as one batch (up to ``max_batch`` rows and
        ``max_batch_tokens`` padded prompt tokens). Cancelling the call stops its row at the next step."""
        req = _Request(messages, sampling, prefix, continuation, concurrent.futures.Future())
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        self._ensure_worker()
        try:
            return await asyncio.wrap_future(req.future)
        except asyncio.CancelledError:
            req.cancelled.set()  # a running row stops at its next step; a queued one never starts
            raise

    def _ensure_worker(self) -> None:
        with self._cv:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._serve, name="paravt-local-batcher", daemon=True)
                self._worker.start()

    def _take_batch(self) -> list[_Request]:
        """The next batch (called with the lock held): requests of the oldest one's kind whose prompt lengths
        are within ``length_ratio`` of each other, at most ``max_batch`` rows and ``max_batch_tokens`` padded
        tokens. A long oldest prompt (``long_prompt_tokens`` or more) lets the short ones waiting beside it go
        first, for at most ``long_patience`` batches."""
        ready = [r for r in self._pending if r.encoded]  # what arrived during the encoding waits a round
        key = _batch_key(ready[0].sampling)
        same = [r for r in ready if _batch_key(r.sampling) == key]
        head = same[0]
        if head.tokens >= self.long_prompt_tokens and head.passed < self.long_patience:
            shorts = [r for r in same if r.tokens * self.length_ratio <= head.tokens]
            if shorts:
                head.passed += 1
                same = shorts
        batch: list[_Request] = []
        lo = hi = 0
        for r in same:
            if len(batch) == self.max_batch:
                break
            low, high = (min(lo, r.tokens), max(hi, r.tokens)) if batch else (r.tokens, r.tokens)
            if batch and (high > self.length_ratio * low or (len(batch) + 1) * high > self.max_batch_tokens):
                continue  # it would pad the others (or the batch past its budget): a later batch
            batch.append(r)
            lo, hi = low, high
        return batch

    def _serve(self) -> None:
        """The batcher: encode what arrived, take a batch (:meth:`_take_batch`), run it, repeat. A fault of its
        own fails the requests waiting (never leaves their callers hanging) and the batcher goes on."""
        while True:
            try:
                self._serve_once()
            except BaseException as exc:  # noqa: BLE001 (a bug here must not strand every caller)
                with self._cv:
                    stranded, self._pending = self._pending, []
                for r in stranded:
                    if not r.future.done() and (r.future.running() or r.future.set_running_or_notify_cancel()):
                        r.future.set_exception(PolicyError(f"the local batcher failed: {exc!r}"))

    def _serve_once(self) -> None:
        """One round: wait for requests, encode the new ones, run one batch."""
        with self._cv:
            while not self._pending:
                self._cv.wait()
            t0 = time.monotonic()
            cap = max(1, self.max_batch)
            while len(self._pending) < cap and (left := self.batch_wait - (time.monotonic() - t0)) > 0:
                self._cv.wait(left)
            fresh = [r for r in self._pending if r.encoded is None]
        for r in fresh:  # encoded here, one at a time: the processor is not shared across threads
            if r.cancelled.is_set() or r.future.cancelled():
                r.encoded = False
                continue
            try:
                r.encoded = self.encode(r.messages, r.prefix, r.continuation)
                r.tokens = len(r.encoded.ids)
            except Exception as exc:  # noqa: BLE001 (handed to that request's caller)
                r.encoded = False
                if r.future.set_running_or_notify_cancel():
                    r.future.set_exception(exc)
        with self._cv:
            self._pending = [r for r in self._pending if r.encoded is not False]
            if not any(r.encoded for r in self._pending):
                return
            batch = self._take_batch() if self.max_batch > 1 else [next(r for r in self._pending if r.encoded)]
            for r in batch:
                self._pending.remove(r)
        live = [r for r in batch if not r.cancelled.is_set() and r.future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            gens = self._run_rows([(r.encoded, r.sampling, r.prefix) for r in live], [r.cancelled for r in live])
        except BaseException as exc:  # the model call itself failed: every waiting caller gets the error
            for r in live:
                r.future.set_exception(exc)
        else:
            for r, g in zip(live, gens, strict=True):
                if isinstance(g, BaseException):
                    r.future.set_exception(g)
                else:
                    r.future.set_result(g)


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


class _scored_distribution:  # noqa: N801 (a context manager used like a function)
    """``generate`` without the model's ``generation_config.json``: a repetition penalty, ``min_new_tokens``,
    bad words … there would change the scores :class:`RowSampler` samples from, while the logprobs recorded
    (and the trainer) use the raw model. ``generate`` fills every setting a call leaves unset from the model's
    config, so the config itself is swapped for a bare one for the call."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        from transformers import GenerationConfig

        self.saved = self.model.generation_config
        self.model.generation_config = GenerationConfig()
        return self

    def __exit__(self, *exc):
        self.model.generation_config = self.saved
        return False


def _images(mm: dict, start: int, count: int) -> dict:
    """Images ``start`` .. ``start + count`` of precomputed vision features (one prompt's)."""
    out = {}
    for name, o in mm.items():
        kw = {"pooler_output": o.pooler_output[start:start + count]}
        if getattr(o, "deepstack_features", None) is not None:
            kw["deepstack_features"] = [layer[start:start + count] for layer in o.deepstack_features]
        out[name] = type(o)(**kw)
    return out


@dataclass(eq=False)  # compared by identity (the list of pending requests removes them one by one)
class _Request:
    messages: list[dict]
    sampling: Sampling
    prefix: str
    continuation: Continuation | None
    future: concurrent.futures.Future
    cancelled: threading.Event = field(default_factory=threading.Event)
    encoded: EncodedPrompt | bool | None = None  # None: not yet; False: dropped (cancelled or unencodable)
    tokens: int = 0
    passed: int = 0  # batches of short prompts that went ahead of this (long) one


class _Cancelled:
    """A stopping criterion: rows whose event is set are done (the others go on)."""

    def __init__(self, events: list[threading.Event]):
        self.events = events

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.tensor([e.is_set() for e in self.events], dtype=torch.bool, device=input_ids.device)


def _batch_key(s: Sampling) -> tuple:
    return (s.max_new_tokens, tuple(s.stop))


class RowSampler:
    """A logits processor that samples each row with its own settings and generator.

    Returns scores that are 0 at the chosen token and -inf elsewhere, so ``generate`` run greedily
    takes exactly that token. Temperature 0 is greedy (argmax of the raw scores).
    """

    def __init__(self, samplings: list[Sampling], banned: list[int] | None = None):
        import torch

        self.samplings = samplings
        self.banned = list(banned or [])  # never chosen (vision placeholders)
        self.first_call: float | None = None  # when the first token's scores arrived (the prefill's end)
        self.generators = []
        for s in samplings:
            g = None
            if s.temperature > 0:
                g = torch.Generator()
                g.manual_seed(s.seed if s.seed is not None else int(torch.randint(0, 2**62, (1,))))
            self.generators.append(g)

    def __call__(self, input_ids, scores):
        import torch

        if self.first_call is None:
            self.first_call = time.perf_counter()
        chosen = torch.empty(scores.shape[0], dtype=torch.long)
        for i, s in enumerate(self.samplings):
            row = scores[i].float()
            if self.banned:
                row = row.index_fill(0, torch.tensor(self.banned, device=row.device), float("-inf"))
            if s.temperature <= 0:
                chosen[i] = int(row.argmax())
                continue
            row = row / s.temperature
            if s.top_k:
                kth = torch.topk(row, min(s.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if s.min_p > 0:
                probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
            if s.top_p < 1.0:
                sp, order = probs.sort(descending=True)
                drop = sp.cumsum(0) - sp > s.top_p  # keep the smallest set whose mass reaches top_p
                probs = probs.scatter(0, order, sp.masked_fill(drop, 0.0))
            chosen[i] = int(torch.multinomial(probs.cpu(), 1, generator=self.generators[i]))
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(scores.shape[0]), chosen.to(scores.device)] = 0.0
        return out
