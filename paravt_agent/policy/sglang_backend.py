"""``sglang``: SGLang's native ``/generate`` with client-side tokenisation (token in, token out).

Request (SGLang ``GenerateRequest``, ``sglang/api/v1/api_types.py``)::
    {"input_ids": [...], "image_data": ["<base64 PNG>", ...],
     "sampling_params": {"temperature", "top_p", "top_k", "min_p", "repetition_penalty": 1,
                         "frequency_penalty": 0, "presence_penalty": 0, "max_new_tokens", "stop",
                         "skip_special_tokens", "sampling_seed"?, "logit_bias" (the banned placeholders)},
     "return_logprob": true, "return_prompt_token_ids": true}

The prompt is the model's own chat template tokenised here (:mod:`paravt_agent.policy.chat`);
the request carries one ``<|image_pad|>`` per image (the server runs its own
image processor and expands it), the forced prefix as token ids, and a later
planner turn continues the previous turn's exact ids. Every sampling setting the
trainer scores is sent explicitly (penalties off, ``min_p``/``top_k``/``top_p`` as
configured): an SGLang server fills unset keys from the model's
``generation_config.json`` (``--sampling-defaults model``, its default), which
would sample from another distribution than the one the trainer scores.
Response: ``output_ids``, ``meta_info.output_token_logprobs`` (``[logprob,
token_id, text]`` triples, temperature-scaled), ``finish_reason``, token counts,
``weight_version`` (a string: the version the last update named) and, for a
request an update interrupted, ``weight_versions`` spans over the output tokens.

What the model consumed is recorded exactly (``Generation.prompt_ids``): the ids
the server reports (``prompt_token_ids``, SGLang 0.5.19+; 0.5.21+ uses
multimodal ``input_ids`` verbatim, expanding only the image placeholders).
Only a server that reports none gets the old emulation: SGLang before 0.5.21
decoded multimodal ids to text and tokenised it again, so the client applies
that round trip (``Generation.prompt_source == "round_trip"``, counted in
:attr:`SGLangPolicy.round_trips`). ``retokenized`` flags a turn whose ids the
server changed (then its earlier turns are not verbatim in its prompt, and the
trainer scores each turn against the prompt it really had). A server whose
image processor gives frames another number of visual tokens than this client
computes is an error, not silent drift; the error names the cause, read from the
server's ``/server_info`` (another model family than this client's processor, or an
image processor started without the family's frame sizes:
:func:`~paravt_agent.policy.families.served_geometry`) and the fix.

A reply that was aborted (``finish_reason.type == "abort"``: a weight update
interrupted it on a server paused with ``abort``) is retried, never returned as a
normal turn.

A server started with ``--api-key`` gets it as ``Authorization: Bearer`` on every
call (``api_key``). A request with ``min_p > 0`` is refused before it is sent when
the server reports deterministic inference (``GET /server_info``,
``enable_deterministic_inference``): SGLang's seeded sampler asserts on min-p
inside the scheduler, which takes the whole server down.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import LoopClients, Policy, being_served, encode_image
from paravt_agent.policy.chat import BANNED_LOGIT, ChatTokenizer, file_token_count
from paravt_agent.policy.endpoints import bearer, deterministic_inference, refuse_min_p
from paravt_agent.policy.families import geometry_of_dir, geometry_of_processor, serve_settings, served_geometry
from paravt_agent.types import Continuation, Generation, Sampling
from paravt_agent.video.geometry import FrameGeometry, processor_size

__all__ = ["DEFAULT_URL", "SGLangPolicy", "bearer", "sampling_params"]

DEFAULT_URL = "http://127.0.0.1:30000"


def sampling_params(sampling: Sampling, banned: tuple[int, ...] | list[int] = ()) -> dict:
    """SGLang ``sampling_params`` for ``sampling``, every key the scored distribution depends on set
    explicitly (an unset key takes the model's ``generation_config.json`` value on an SGLang server).
    ``banned`` tokens (the vision placeholders) get :data:`~paravt_agent.policy.chat.BANNED_LOGIT` as their
    ``logit_bias``: SGLang adds it before sampling and before the logprobs it returns, so the server samples
    and reports the distribution the trainer scores (the local sampler and the trainer ban the same ids)."""
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k or -1,
        "min_p": sampling.min_p,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "max_new_tokens": sampling.max_new_tokens,
        "skip_special_tokens": False,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    if banned:
        params["logit_bias"] = {str(int(t)): BANNED_LOGIT for t in banned}
    return params


class SGLangPolicy(Policy):
    name = "sglang"
    returns_tokens = True
    reports_service = True
    receives_weights = True  # the trainer pushes weights with SGLang's admin API (paravt_train.sync)

    def __init__(
        self,
        model: str,
        endpoint: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        concurrency: int = 64,
        processor=None,
        lora: str | None = None,
        api_key: str | None = None,
    ):
        self.model = model
        self.lora = lora  # a LoRA adapter loaded on the server under this name: every request names it
        self.api_key = api_key  # the server's --api-key, sent as a bearer token
        self._deterministic: bool | None = None  # the server's enable_deterministic_inference, once asked
        url = (endpoint or DEFAULT_URL).rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.timeout, self.max_retries, self.concurrency = timeout, max_retries, concurrency
        self._processor = processor
        self._chat: ChatTokenizer | None = None
        self._load_lock = threading.Lock()
        self._clients = LoopClients(self._make_client, concurrency)
        self.round_trips = 0  # turns whose prompt ids came from emulating the old decode -> tokenise round trip
        self.server_ids = 0  # turns whose prompt ids the server reported
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
                    self._chat = ChatTokenizer(processor, self.model_type)
        return self._chat

    @property
    def frame_geometry(self) -> FrameGeometry | None:
        """The served model's geometry as this client's processor states it (the processor given, else the model
        directory's files, else the processor loaded by name); None when none can be read."""
        if self._processor is not None:
            return geometry_of_processor(self._processor, self.model_type, f"the processor of {self.model}")
        found = geometry_of_dir(self.model)
        if found is not None:
            return found
        try:
            return self.chat.geometry
        except PolicyError:
            return None

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        return tuple(self.chat.placeholder_ids)

    def count_text_tokens(self, text: str) -> int:
        if self._chat is None:  # the processor is not loaded yet: a local model directory's tokenizer file answers
            n = file_token_count(self.model, text)
            if n is not None:
                return n
        return len(self.chat.tokens(text))

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    def _make_client(self):
        import httpx

        return httpx.AsyncClient(timeout=self.timeout, headers=self.headers)

    def server_info(self) -> dict:
        """``GET /server_info`` of the server (its resolved arguments); ``{}`` when it does not answer one (a router
        answers 404: :meth:`server_deterministic` asks its workers)."""
        import httpx

        try:
            resp = httpx.get(f"{self.url}/server_info", headers=self.headers, timeout=30)
        except httpx.HTTPError:
            return {}
        if resp.status_code in (401, 403):
            raise PolicyError(f"{self.url}/server_info answered HTTP {resp.status_code}: the server was started "
                              "with --api-key; give the sglang backend that key (api_key)")
        try:
            data = resp.json() if resp.status_code == 200 else {}
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def server_deterministic(self) -> bool | None:
        """Whether the server samples with SGLang's seeded sampler (``--enable-deterministic-inference``), as it —
        or every worker behind a router (:func:`~paravt_agent.policy.endpoints.deterministic_inference`) — says:
        remembered once known; None, and asked again next time, while it cannot be told (a worker that does not
        answer, a server still starting)."""
        if self._deterministic is None:
            import httpx

            with httpx.Client() as client:
                try:
                    self._deterministic = deterministic_inference(client, self.url, self.headers)
                except PermissionError as exc:
                    raise PolicyError(f"{exc}: give the sglang backend that key (api_key)") from None
        return self._deterministic

    async def _refuse_min_p(self, sampling: Sampling) -> None:
        if sampling.min_p > 0:
            refuse_min_p(self.url, sampling.min_p, await asyncio.to_thread(self.server_deterministic))

    def _client(self):
        return self._clients.get()

    def build_request(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                      continuation: Continuation | None = None) -> tuple[dict, dict]:
        """The ``/generate`` payload and what this client expects the server to consume: ``{"ids" (expanded,
        verbatim), "compact", "prefix_ids", "grids", "retokenized", "multimodal"}``."""
        chat = self.chat
        enc = chat.encode(messages, prefix, continuation, pixels=False)
        compact = chat.compact(enc.ids)
        params = sampling_params(sampling, chat.placeholder_ids)
        payload = {"input_ids": compact, "sampling_params": params, "return_logprob": True,
                   "return_prompt_token_ids": True}
        if enc.images:
            payload["image_data"] = [encode_image(img) for img in enc.images]
        if self.lora:  # SGLang applies an adapter only to the requests that name it (`lora_path`: its name)
            payload["lora_path"] = self.lora
        seen = {"ids": list(enc.ids), "compact": compact, "prefix_ids": list(enc.prefix_ids),
                "grids": enc.image_grid_thw, "retokenized": enc.retokenized, "multimodal": bool(enc.images),
                "sizes": [tuple(img.shape[:2]) for img in enc.images]}
        return payload, seen

    def consumed(self, data: dict, seen: dict) -> tuple[list[int], str, bool]:
        """The ids the model consumed, where they came from (``server`` | ``client`` | ``round_trip``) and
        whether they differ from the ids this client sent (beyond the image expansion)."""
        chat = self.chat
        meta = data.get("meta_info") or {}
        reported = data.get("prompt_token_ids") or meta.get("prompt_token_ids")
        image = chat.image_token_id
        expected = seen["ids"]
        if reported:
            reported = [int(t) for t in reported]
            if reported.count(image) != expected.count(image):
                raise PolicyError(self._size_error(reported.count(image), expected.count(image), "visual tokens",
                                                   seen))
            return reported, "server", reported != expected
        if seen["multimodal"]:  # a server that reports no ids: SGLang < 0.5.21 re-tokenised multimodal ids
            trip = chat.round_trip(seen["compact"])
            ids = chat.expand(trip, seen["grids"]) if trip.count(image) == len(seen["grids"]) else expected
            source = "round_trip"
        else:
            ids, source = expected, "client"
        served = meta.get("prompt_tokens")
        if served is not None and int(served) != len(ids):
            raise PolicyError(self._size_error(int(served), len(ids), "prompt tokens", seen))
        return ids, source, ids != expected

    def _size_error(self, served: int, computed: int, what: str, seen: dict) -> str:
        """The mismatch, its cause read from the server (``/server_info``) and the fix."""
        head = (f"{self.url} consumed {served} {what} but this client computed {computed}, so training would score "
                "other tokens than the server consumed: ")
        mine = self.chat.geometry
        try:
            info = self.server_info()
        except PolicyError:
            info = {}
        theirs = served_geometry(info, fallback=mine) if info else None
        if theirs is None:
            return head + ("the server's image processor sizes frames differently from this client's, and it does not "
                           "say how (no /server_info); start it with `paravt serve MODEL`, which gives SGLang the "
                           "model family's frame sizes")
        if theirs.unit != mine.unit:
            return head + (f"the server serves {theirs.describe()}, but this client tokenises for {mine.describe()}; "
                           "give the sglang backend the served model's directory (model=...)")
        flag = json.dumps(serve_settings(mine), separators=(",", ":"))
        resized = [(h, w, mine.tokens(h, w), theirs_tokens) for h, w in seen.get("sizes", [])
                   if (theirs_tokens := _tokens(theirs, h, w)) != mine.tokens(h, w)]
        example = ""
        if resized:
            h, w, here, there = resized[0]
            example = (f"; a {w}x{h} frame is {here} visual token{'s' * (here != 1)} here and {there} there "
                       f"({len(resized)} of the {len(seen.get('sizes', []))} frames differ)")
        return head + (f"the server's image processor keeps images between {theirs.min_pixels} and "
                       f"{theirs.max_pixels} pixels, where this client keeps the frames it sized at "
                       f"{mine.unit * mine.unit} (one {mine.unit}x{mine.unit} unit) to {mine.max_pixels} pixels"
                       f"{example}. The server was started without {mine.family or 'the model'}'s frame sizes: "
                       f"restart it with `paravt serve MODEL` (it passes them), or add --mm-process-config '{flag}' "
                       "to its SGLang command")

    def parse_response(self, data: dict, seen: dict, prefix: str, t0: float) -> Generation:
        meta = data.get("meta_info") or {}
        lp = meta.get("output_token_logprobs") or []
        ids = data.get("output_ids")
        if ids is None:
            ids = [int(x[1]) for x in lp]
        logprobs = [float(x[0]) for x in lp] if lp else None
        if logprobs is not None and len(logprobs) != len(ids):
            raise PolicyError(f"{self.url}/generate returned {len(ids)} ids but {len(logprobs)} logprobs")
        consumed, source, changed = self.consumed(data, seen)
        want = seen["prefix_ids"]
        prefix_ids = want if want and consumed[len(consumed) - len(want):] == want else []
        fr = meta.get("finish_reason") or {}
        reason = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
        eos = self.chat.eos_id
        body = ids[:-1] if ids and ids[-1] == eos else ids
        text = data.get("text")
        if text is None or (ids and ids[-1] == eos and text.endswith("<|im_end|>")):
            text = self.chat.tokenizer.decode(body, skip_special_tokens=False)
        version = meta.get("weight_version")
        spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or []
                 if isinstance(s, dict)]
        return Generation(
            text=prefix + text, prefix=prefix, finish_reason=reason,
            prompt_tokens=len(consumed), completion_tokens=int(meta.get("completion_tokens", len(ids))),
            latency=time.perf_counter() - t0, prompt_ids=consumed[: len(consumed) - len(prefix_ids)],
            prefix_ids=list(prefix_ids), output_ids=list(ids), logprobs=logprobs,
            logprob_temperature=None, image_grid_thw=list(seen["grids"]),
            retokenized=seen["retokenized"] or changed, prompt_source=source,
            weight_version=None if version is None else str(version), weight_versions=spans,
        )

    async def _post(self, payload: dict) -> dict:
        import httpx

        client, sem = self._client()
        delay = 0.5
        async with sem:
            being_served()  # out of this client's queue: the agent's timeouts count from here
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
                    elif resp.status_code in (401, 403):
                        raise PolicyError(f"{self.url}/generate answered HTTP {resp.status_code}: the server was "
                                          "started with --api-key; give the sglang backend that key (api_key, "
                                          "`--api-key`, or sync.api_key_env in a training config)")
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
                       continuation: Continuation | None = None, role: str = "planner") -> Generation:
        t0 = time.perf_counter()
        await self._refuse_min_p(sampling)
        payload, seen = await asyncio.to_thread(self.build_request, messages, sampling, prefix, continuation)
        data = await self._post(payload)
        gen = self.parse_response(data, seen, prefix, t0)
        gen.logprob_temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        self.requests += 1
        self.round_trips += int(gen.prompt_source == "round_trip")
        self.server_ids += int(gen.prompt_source == "server")
        return gen

    async def aclose(self) -> None:
        await self._clients.aclose(lambda c: c.aclose())


def _tokens(geometry: FrameGeometry, height: int, width: int) -> int:
    """Visual tokens of an image under a server's own min/max pixels (``geometry`` as served)."""
    h, w = processor_size(height, width, geometry.unit, geometry.min_pixels, geometry.max_pixels)
    return (h // geometry.unit) * (w // geometry.unit)


def _json(resp, url: str) -> dict:
    try:
        data = resp.json()
    except ValueError:
        raise PolicyError(f"{url}/generate answered 200 with a body that is not JSON: {resp.text[:200]!r}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{url}/generate answered 200 with {type(data).__name__}, not a JSON object")
    return data
