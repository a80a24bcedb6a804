"""``sglang``: SGLang's native ``/generate`` with client-side tokenisation (token in, token out).

Request (SGLang ``GenerateReqInput``)::

    {"input_ids": [...], "image_data": ["<base64 PNG>", ...],
     "sampling_params": {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "skip_special_tokens",
                         "sampling_seed"?},
     "return_logprob": true}

The prompt is the model's own chat template tokenised here (:mod:`paravt_agent.policy.chat`);
the request carries one ``<|image_pad|>`` per image (the server runs its own
image processor and expands it), the forced prefix as token ids, and a later
planner turn continues the previous turn's exact ids. Response: ``output_ids``,
``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples,
temperature-scaled), ``finish_reason``, token counts.

What the model consumed is recorded exactly (``Generation.prompt_ids``: expanded
image placeholders, ``image_grid_thw``): for multimodal requests SGLang decodes
``input_ids`` to text and tokenises that text again, so the client applies the
same round trip and records its result; ``retokenized`` flags a turn whose ids
changed on the way (then its earlier turns are not verbatim in its prompt, and
the trainer scores each turn against the prompt it really had). The server's
reported prompt length is checked against the client's expansion: a server whose
image processor resizes frames differently is an error, not silent drift.

A reply that was aborted (``finish_reason.type == "abort"``: a weight update
interrupted it on an SGLang that aborts on pause) is retried, never returned as a
normal turn.
"""

from __future__ import annotations

import asyncio
import threading
import time

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import Policy, encode_image
from paravt_agent.policy.chat import ChatTokenizer
from paravt_agent.types import Continuation, Generation, Sampling

__all__ = ["DEFAULT_URL", "SGLangPolicy"]

DEFAULT_URL = "http://127.0.0.1:30000"


class SGLangPolicy(Policy):
    name = "sglang"
    returns_tokens = True

    def __init__(
        self,
        model: str,
        endpoint: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        concurrency: int = 64,
        processor=None,
    ):
        self.model = model
        url = (endpoint or DEFAULT_URL).rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.timeout, self.max_retries, self.concurrency = timeout, max_retries, concurrency
        self._processor = processor
        self._chat: ChatTokenizer | None = None
        self._load_lock = threading.Lock()
        self._clients: dict[int, tuple] = {}
        self.round_trips = 0  # prompts the server's decode -> tokenise round trip changed
        self.requests = 0

    @property
    def processor(self):
        # loaded once, under a lock: the first requests tokenise in worker threads at the same time, and
        # transformers' lazy top-level imports are not safe to race ("cannot import name AutoProcessor")
        if self._processor is None:
            with self._load_lock:
                if self._processor is None:
                    from transformers import AutoProcessor

                    try:
                        self._processor = AutoProcessor.from_pretrained(self.model)
                    except OSError as exc:
                        msg = f"cannot load the processor of {self.model} for client-side tokenisation: {exc}"
                        raise PolicyError(msg) from exc
        return self._processor

    @property
    def chat(self) -> ChatTokenizer:
        if self._chat is None:
            processor = self.processor
            with self._load_lock:
                if self._chat is None:
                    self._chat = ChatTokenizer(processor)
        return self._chat

    def _client(self):
        import httpx

        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[2] is not loop:
            entry = (httpx.AsyncClient(timeout=self.timeout), asyncio.Semaphore(self.concurrency), loop)
            self._clients[id(loop)] = entry
        return entry[0], entry[1]

    def build_request(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                      continuation: Continuation | None = None) -> tuple[dict, dict]:
        """The ``/generate`` payload and what the server will consume: ``{"ids", "prefix_ids", "grids",
        "retokenized"}`` (expanded ids after the server's decode -> tokenise round trip)."""
        chat = self.chat
        enc = chat.encode(messages, prefix, continuation, pixels=False)
        compact = chat.compact(enc.ids)
        params = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "max_new_tokens": sampling.max_new_tokens,
            "skip_special_tokens": False,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        payload = {"input_ids": compact, "sampling_params": params, "return_logprob": True}
        consumed_compact = compact
        if enc.images:
            payload["image_data"] = [encode_image(img) for img in enc.images]
            consumed_compact = chat.round_trip(compact)  # what SGLang does to multimodal input_ids
        consumed = chat.expand(consumed_compact, enc.image_grid_thw)
        prefix_ids = enc.prefix_ids if consumed[len(consumed) - len(enc.prefix_ids):] == enc.prefix_ids else []
        seen = {"ids": consumed, "prefix_ids": prefix_ids, "grids": enc.image_grid_thw,
                "round_trip_changed": consumed_compact != compact,
                "retokenized": enc.retokenized or consumed_compact != compact}
        return payload, seen

    def parse_response(self, data: dict, seen: dict, prefix: str, t0: float) -> Generation:
        meta = data.get("meta_info") or {}
        lp = meta.get("output_token_logprobs") or []
        ids = data.get("output_ids")
        if ids is None:
            ids = [int(x[1]) for x in lp]
        logprobs = [float(x[0]) for x in lp] if lp else None
        if logprobs is not None and len(logprobs) != len(ids):
            raise PolicyError(f"{self.url}/generate returned {len(ids)} ids but {len(logprobs)} logprobs")
        n_prompt = len(seen["ids"])
        served = meta.get("prompt_tokens")
        if served is not None and int(served) != n_prompt:
            raise PolicyError(
                f"{self.url} consumed a {served}-token prompt but the client computed {n_prompt} tokens: the "
                "server's image processor sizes frames differently from this client's (serve the model with "
                "`paravt serve`, which keeps the frame protocol's sizes), so training would score other tokens")
        fr = meta.get("finish_reason") or {}
        reason = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
        eos = self.chat.eos_id
        body = ids[:-1] if ids and ids[-1] == eos else ids
        text = data.get("text")
        if text is None or (ids and ids[-1] == eos and text.endswith("<|im_end|>")):
            text = self.chat.tokenizer.decode(body, skip_special_tokens=False)
        prefix_ids = seen["prefix_ids"]
        return Generation(
            text=prefix + text, prefix=prefix, finish_reason=reason,
            prompt_tokens=n_prompt, completion_tokens=int(meta.get("completion_tokens", len(ids))),
            latency=time.perf_counter() - t0, prompt_ids=seen["ids"][: n_prompt - len(prefix_ids)],
            prefix_ids=list(prefix_ids), output_ids=list(ids), logprobs=logprobs,
            logprob_temperature=None, image_grid_thw=list(seen["grids"]), retokenized=seen["retokenized"],
        )

    async def _post(self, payload: dict) -> dict:
        import httpx

        client, sem = self._client()
        delay = 0.5
        async with sem:
            for attempt in range(self.max_retries + 1):
                problem = None
                try:
                    resp = await client.post(f"{self.url}/generate", json=payload)
                except (httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError) as exc:
                    problem = PolicyError(
                        f"cannot reach the SGLang server at {self.url} ({exc}); start one with "
                        "`paravt serve MODEL` (needs a GPU) or use --backend local", transient=True)
                else:
                    if resp.status_code == 200:
                        data = _json(resp, self.url)
                        fr = (data.get("meta_info") or {}).get("finish_reason") or {}
                        if not (isinstance(fr, dict) and fr.get("type") == "abort"):
                            return data
                        problem = PolicyError(f"{self.url}/generate aborted the request ({fr.get('message', '')}): "
                                              "a weight update interrupted it", transient=True)
                    elif resp.status_code < 500 and resp.status_code != 429:
                        raise PolicyError(f"{self.url}/generate answered HTTP {resp.status_code}: {resp.text[:300]}")
                    else:
                        problem = PolicyError(f"{self.url}/generate answered HTTP {resp.status_code}: "
                                              f"{resp.text[:300]}", transient=True)
                if attempt == self.max_retries:
                    raise problem
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None) -> Generation:
        t0 = time.perf_counter()
        payload, seen = await asyncio.to_thread(self.build_request, messages, sampling, prefix, continuation)
        data = await self._post(payload)
        gen = self.parse_response(data, seen, prefix, t0)
        gen.logprob_temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        self.requests += 1
        self.round_trips += int(seen["round_trip_changed"])
        return gen

    async def aclose(self) -> None:
        for client, _, loop in list(self._clients.values()):
            if loop is asyncio.get_running_loop():
                await client.aclose()
        self._clients.clear()


def _json(resp, url: str) -> dict:
    try:
        data = resp.json()
    except ValueError:
        raise PolicyError(f"{url}/generate answered 200 with a body that is not JSON: {resp.text[:200]!r}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{url}/generate answered 200 with {type(data).__name__}, not a JSON object")
    return data
