"""``sglang``: SGLang's native ``/generate`` with client-side tokenisation (token in, token out).

Request (SGLang ``GenerateReqInput``)::

    {"input_ids": [...], "image_data": ["<base64 PNG>", ...],
     "sampling_params": {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "skip_special_tokens"},
     "return_logprob": true}

The prompt is the model's own chat template tokenised here (one
``<|image_pad|>`` per image; the server expands it), the forced prefix appended
as token ids; a later planner turn is the previous turn's exact ids continued by
the new messages' tokens. Response: ``output_ids`` and ``meta_info.output_token_logprobs``
(``[logprob, token_id, text]`` triples), ``finish_reason``, token counts.
Needs a GPU server to run for real (``paravt serve``); verified here against
recorded payloads of the documented shape only.
"""

from __future__ import annotations

import asyncio
import time

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import (
    Generation,
    Policy,
    Sampling,
    continuation_text,
    continued_ids,
    encode_image,
    last_token_turn,
)

__all__ = ["SGLangPolicy"]

DEFAULT_URL = "http://127.0.0.1:30000"


class SGLangPolicy(Policy):
    name = "sglang"

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
        self._clients: dict[int, tuple] = {}

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            try:
                self._processor = AutoProcessor.from_pretrained(self.model)
            except OSError as exc:
                msg = f"cannot load the processor of {self.model} for client-side tokenisation: {exc}"
                raise PolicyError(msg) from exc
        return self._processor

    def _client(self):
        import httpx

        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[2] is not loop:
            entry = (httpx.AsyncClient(timeout=self.timeout), asyncio.Semaphore(self.concurrency), loop)
            self._clients[id(loop)] = entry
        return entry[0], entry[1]

    def build_request(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> tuple[dict, list[int]]:
        """The ``/generate`` payload and the prefix token ids."""
        from paravt_agent.policy.local import to_hf_messages

        chat, images = to_hf_messages(messages)
        tok = self.processor.tokenizer

        def render(msgs, add_generation_prompt):
            return self.processor.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)

        # later planner turns continue from the previous turn's exact ids (never re-tokenise model output)
        k, prev = last_token_turn(messages)
        tail = continuation_text(render, chat, k) if prev is not None else None
        if tail is None:
            prompt_ids = tok(render(chat, True), add_special_tokens=False)["input_ids"]
        else:
            eos = tok.convert_tokens_to_ids("<|im_end|>")
            prompt_ids = continued_ids(prev, eos) + tok(tail, add_special_tokens=False)["input_ids"]
        prefix_ids = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
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
        payload = {"input_ids": prompt_ids + prefix_ids, "sampling_params": params, "return_logprob": True}
        if images:
            import numpy as np

            payload["image_data"] = [encode_image(np.asarray(img)) for img in images]
        return payload, prefix_ids

    def parse_response(self, data: dict, payload: dict, prefix: str, prefix_ids: list[int], t0: float) -> Generation:
        meta = data.get("meta_info") or {}
        lp = meta.get("output_token_logprobs") or []
        ids = data.get("output_ids")
        if ids is None:
            ids = [int(x[1]) for x in lp]
        logprobs = [float(x[0]) for x in lp] if lp else None
        if logprobs is not None and len(logprobs) != len(ids):
            raise PolicyError(f"{self.url}/generate returned {len(ids)} ids but {len(logprobs)} logprobs")
        fr = meta.get("finish_reason") or {}
        reason = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
        tok = self.processor.tokenizer
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        body = ids[:-1] if ids and ids[-1] == eos else ids
        text = data.get("text")
        if text is None or (ids and ids[-1] == eos and text.endswith("<|im_end|>")):
            text = tok.decode(body, skip_special_tokens=False)
        n_prompt = len(payload["input_ids"])
        return Generation(
            text=prefix + text, prefix=prefix, finish_reason=reason,
            prompt_tokens=int(meta.get("prompt_tokens", n_prompt)), completion_tokens=int(meta.get("completion_tokens", len(ids))),
            latency=time.perf_counter() - t0, prompt_ids=payload["input_ids"][: n_prompt - len(prefix_ids)],
            prefix_ids=list(prefix_ids), output_ids=list(ids), logprobs=logprobs,
        )

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "") -> Generation:
        import httpx

        t0 = time.perf_counter()
        payload, prefix_ids = await asyncio.to_thread(self.build_request, messages, sampling, prefix)
        client, sem = self._client()
        delay = 0.5
        async with sem:
            for attempt in range(self.max_retries + 1):
                try:
                    resp = await client.post(f"{self.url}/generate", json=payload)
                except (httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError) as exc:
                    if attempt == self.max_retries:
                        raise PolicyError(
                            f"cannot reach the SGLang server at {self.url} ({exc}); start one with "
                            "`paravt serve MODEL` (needs a GPU) or use --backend local",
                            transient=True,
                        ) from exc
                else:
                    if resp.status_code < 500:
                        break
                    if attempt == self.max_retries:
                        raise PolicyError(f"{self.url}/generate answered HTTP {resp.status_code}: {resp.text[:300]}",
                                          transient=True)
                await asyncio.sleep(delay)
                delay *= 2
        if resp.status_code != 200:
            raise PolicyError(f"{self.url}/generate answered HTTP {resp.status_code}: {resp.text[:300]}")
        return self.parse_response(resp.json(), payload, prefix, prefix_ids, t0)

    async def aclose(self) -> None:
        for client, _, loop in list(self._clients.values()):
            if loop is asyncio.get_running_loop():
                await client.aclose()
        self._clients.clear()
