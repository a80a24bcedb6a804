"""Batching for the ``local`` backend: the request queue that turns concurrent calls into batches, and what
each batch needs to sample its rows independently (:class:`RowSampler`) from the raw model's distribution.

See :mod:`paravt_agent.policy.local` for the batching and fairness rules."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import SERVE_CLOCK, ServeClock
from paravt_agent.policy.chat import EncodedPrompt, ban
from paravt_agent.types import Continuation, Generation, Sampling

__all__ = ["QueuedBatcher", "RowSampler", "batch_key", "cancelled_rows", "scored_distribution"]


class QueuedBatcher:
    """The queue in front of a batch runner: concurrent ``generate`` calls that arrive together run as one batch
    (the fairness rules are in :meth:`_take_batch`). A backend holds one (``LocalPolicy.batcher``), made with what it
    needs of the backend: ``encode(messages, prefix, continuation)`` → an encoded prompt, and ``run_rows(rows,
    cancel_events)`` → one Generation (or exception) per row; and the batching settings, which stay adjustable
    (``batcher.max_batch = 4``)."""

    def __init__(self, encode, run_rows, max_batch: int = 8, batch_wait: float = 0.005, max_batch_tokens: int = 32768,
                 length_ratio: float = 4.0, long_prompt_tokens: int = 2048, long_patience: int = 4):
        self.encode, self.run_rows = encode, run_rows
        self.max_batch = max_batch
        self.batch_wait = batch_wait
        self.max_batch_tokens = max_batch_tokens
        self.length_ratio = length_ratio
        self.long_prompt_tokens = long_prompt_tokens
        self.long_patience = long_patience
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._worker: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """Requests queued or being encoded (not yet in a batch)."""
        with self._cv:
            return len(self._pending)

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None) -> Generation:
        """Queued: concurrent calls that arrive together run as one batch (up to ``max_batch`` rows and
        ``max_batch_tokens`` padded prompt tokens). Cancelling the call stops its row at the next step."""
        req = _Request(messages, sampling, prefix, continuation, concurrent.futures.Future(), clock=SERVE_CLOCK.get())
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
        key = batch_key(ready[0].sampling)
        same = [r for r in ready if batch_key(r.sampling) == key]
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
        for r in live:  # served from here on: the caller's timeout counts this batch's work, not the wait before it
            if r.clock is not None:
                r.clock.start()
        try:
            gens = self.run_rows([(r.encoded, r.sampling, r.prefix) for r in live], [r.cancelled for r in live])
        except BaseException as exc:  # the model call itself failed: every waiting caller gets the error
            for r in live:
                r.future.set_exception(exc)
        else:
            for r, g in zip(live, gens, strict=True):
                if isinstance(g, BaseException):
                    r.future.set_exception(g)
                else:
                    r.future.set_result(g)


class scored_distribution:  # noqa: N801 (a context manager used like a function)
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
    clock: ServeClock | None = None  # the caller's (paravt_agent.policy.base.SERVE_CLOCK), started with its batch


class cancelled_rows:  # noqa: N801 (a stopping criterion used like a function)
    """A stopping criterion: rows whose event is set are done (the others go on). While no row is cancelled (the
    common case) it hands back the same all-False tensor every step: no host-to-device copy per token."""

    def __init__(self, events: list[threading.Event]):
        self.events = events
        self._none = None  # the all-False answer, made once on the model's device

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        flags = [e.is_set() for e in self.events]
        if any(flags):
            return torch.tensor(flags, dtype=torch.bool, device=input_ids.device)
        if self._none is None:
            self._none = torch.zeros(len(flags), dtype=torch.bool, device=input_ids.device)
        return self._none


def batch_key(s: Sampling) -> tuple:
    return (s.max_new_tokens, tuple(s.stop))


class RowSampler:
    """A logits processor that samples each row with its own settings and generator.

    Returns scores that are 0 at the chosen token and -inf elsewhere, so ``generate`` run greedily
    takes exactly that token. Temperature 0 is greedy (argmax of the raw scores).

    Per decoding step it makes no host sync and no host-to-device copy: the banned ids live on the model's
    device, greedy rows take one batched argmax, and a sampled row draws on the device with its own generator
    there (on a GPU every ``int(tensor)`` would stall the step until the GPU is idle).
    """

    def __init__(self, samplings: list[Sampling], banned: list[int] | None = None):
        import torch

        self.samplings = samplings
        self.banned = list(banned or [])  # never chosen (vision placeholders)
        self.first_call: float | None = None  # when the first token's scores arrived (the prefill's end)
        # the seeds are drawn now (the global generator's order does not depend on the device); the generators are
        # made on the first call, on the scores' device
        self.seeds = [None if s.temperature <= 0 else
                      (s.seed if s.seed is not None else int(torch.randint(0, 2**62, (1,))))
                      for s in samplings]
        self.generators: list = []
        self._banned_ids = None  # the banned ids as a tensor on the scores' device

    def _setup(self, device) -> None:
        import torch

        self.generators = [None if seed is None else torch.Generator(device=device).manual_seed(seed)
                           for seed in self.seeds]
        self._banned_ids = torch.tensor(self.banned, dtype=torch.long, device=device) if self.banned else None

    def __call__(self, input_ids, scores):
        import torch

        if self.first_call is None:
            self.first_call = time.perf_counter()
            self._setup(scores.device)
        x = ban(scores.float(), self._banned_ids)  # before the temperature, as SGLang adds its logit_bias
        chosen = x.argmax(dim=-1)  # every row greedy; the sampled rows draw below
        for i, s in enumerate(self.samplings):
            if s.temperature > 0:
                chosen[i] = _draw(x[i] / s.temperature, s, self.generators[i])
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen[:, None], 0.0)


def _draw(row, s: Sampling, generator):
    """One token (a 1-element tensor on ``row``'s device) from the temperature-scaled logits ``row`` under
    ``s``'s top-k, min-p and top-p."""
    import torch

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
    return torch.multinomial(probs, 1, generator=generator)[0]
