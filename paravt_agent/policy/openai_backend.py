"""``openai``: any OpenAI-compatible chat endpoint (SGLang, vLLM, ``transformers serve``, hosted APIs).

Frames travel as base64 ``image_url`` parts after their ``<t seconds>`` labels.
Retries with exponential backoff on connection errors, timeouts, 429 and 5xx
come from the ``openai`` client (``max_retries``); a semaphore bounds requests
in flight. A forced response prefix (the think prefix) is sent as a trailing
assistant message with ``continue_final_message`` (understood by SGLang and vLLM;
``prefill=True``, the default). For an endpoint without that extension (e.g.
``transformers serve``) construct the policy with ``prefill=False`` and run the
agent with ``think_prefix: ""``: a prefix this backend cannot pin is refused
with a clear error, never silently dropped.
"""

from __future__ import annotations

import asyncio
import time

from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import LoopClients, Policy, being_served, encode_image, map_images
from paravt_agent.policy.endpoints import bearer, deterministic_inference, refuse_min_p
from paravt_agent.types import Continuation, Generation, Sampling

__all__ = ["DEFAULT_ENDPOINT", "OpenAIPolicy", "to_openai_messages"]

DEFAULT_ENDPOINT = "http://127.0.0.1:30000/v1"

HOW_TO_START = (
    "Start a server, e.g. `paravt serve MODEL` (SGLang, GPU) or "
    "`transformers serve MODEL_DIR --host 127.0.0.1 --port 8000` (CPU), and pass its URL with --endpoint; "
    "or use the in-process backend: --backend local --model MODEL_DIR."
)


def to_openai_messages(messages: list[dict], image_format: str = "PNG") -> list[dict]:
    """Neutral messages -> OpenAI chat messages, frames as base64 ``image_url`` parts."""
    mime = "image/png" if image_format.upper() == "PNG" else "image/jpeg"
    return map_images(messages, lambda img: {
        "type": "image_url", "image_url": {"url": f"data:{mime};base64,{encode_image(img, image_format)}"}})


class OpenAIPolicy(Policy):
    name = "openai"
    reports_service = True  # a request is served once it has a connection slot (the server's own queue is not seen)

    def __init__(
        self,
        model: str | None = None,
        endpoint: str | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_retries: int = 1,
        concurrency: int = 16,
        prefill: bool = True,
        image_format: str = "PNG",
        extra_body: dict | None = None,
    ):
        self.endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self.model = model
        self.api_key = api_key or "EMPTY"
        self._deterministic: bool | None = None  # whether SGLang's seeded sampler serves it (min_p guard), once known
        self.timeout, self.max_retries = timeout, max_retries
        self.concurrency = concurrency
        self.prefill = prefill
        self.image_format = image_format
        self.extra_body = dict(extra_body or {})
        self._clients = LoopClients(self._make_client, concurrency)

    def _make_client(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.endpoint, api_key=self.api_key, timeout=self.timeout,
                           max_retries=self.max_retries)

    def _client(self):
        return self._clients.get()

    async def _model_name(self, client) -> str:
        if self.model:
            return self.model
        models = await client.models.list()
        if not models.data:
            raise PolicyError(f"{self.endpoint} serves no model; pass model=...")
        self.model = models.data[0].id
        return self.model

    @property
    def supports_prefix(self) -> bool:
        return self.prefill

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None, role: str = "planner") -> Generation:
        import openai
        from openai.types.chat import ChatCompletion

        if prefix and not self.prefill:
            raise PolicyError(f"the openai backend was built with prefill=False and cannot pin the response prefix "
                              f"{prefix!r} on {self.endpoint}; set think_prefix: '' in the agent config, or use an "
                              "endpoint that understands continue_final_message (SGLang, vLLM) with prefill=True")
        client, sem = self._client()
        t0 = time.perf_counter()
        # encoding frames is CPU work: off the event loop, so K sub-agents' requests do not queue behind it
        payload = await asyncio.to_thread(to_openai_messages, messages, self.image_format)
        extra = dict(self.extra_body)
        if prefix and self.prefill:
            payload.append({"role": "assistant", "content": prefix})
            extra.update(continue_final_message=True, add_generation_prompt=False)
        kw = dict(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens)
        if sampling.seed is not None:
            kw["seed"] = sampling.seed
        if sampling.stop:
            kw["stop"] = list(sampling.stop)
        if sampling.top_k:
            extra["top_k"] = sampling.top_k
        if sampling.min_p:
            await self._refuse_min_p(sampling.min_p)
            extra["min_p"] = sampling.min_p  # SGLang, vLLM
        async with sem:
            being_served()  # out of this client's queue: the agent's timeouts count from here
            try:
                model = await self._model_name(client)
                # a plain POST (documented "custom request" path): skips the SDK's per-field request
                # transform, which costs milliseconds per image-laden message
                resp = await client.post(
                    "/chat/completions", cast_to=ChatCompletion,
                    body={"model": model, "messages": payload, **kw, **extra},
                )
            except openai.APIConnectionError as exc:
                msg = f"cannot reach the model endpoint {self.endpoint} ({exc}). {HOW_TO_START}"
                raise PolicyError(msg, transient=True) from exc
            except openai.APIStatusError as exc:
                transient = exc.status_code >= 500 or exc.status_code == 429
                msg = f"{self.endpoint} answered HTTP {exc.status_code}: {exc.message}"
                raise PolicyError(msg, transient=transient) from exc
            except (ValueError, openai.APIResponseValidationError) as exc:  # 200 with a body that is not JSON
                raise PolicyError(f"{self.endpoint} answered 200 with a body that is not a chat completion "
                                  f"(not JSON: {exc}); is the URL an OpenAI-compatible /v1 endpoint?") from exc
        if not isinstance(resp, ChatCompletion):
            shown = str(resp)[:120].replace("\n", " ")
            raise PolicyError(f"{self.endpoint} answered 200 with {type(resp).__name__} {shown!r}, not a chat "
                              "completion (a proxy or web page?); is the URL an OpenAI-compatible /v1 endpoint?")
        if not resp.choices:
            raise PolicyError(f"{self.endpoint} returned no choices")
        choice = resp.choices[0]
        text = choice.message.content or ""
        if prefix and self.prefill and not text.startswith(prefix):
            text = prefix + text
        usage = resp.usage
        return Generation(
            text=text,
            prefix=prefix if self.prefill else "",
            finish_reason=choice.finish_reason or "stop",
            prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            completion_tokens=getattr(usage, "completion_tokens", 0) or 0,
            latency=time.perf_counter() - t0,
        )

    async def _refuse_min_p(self, min_p: float) -> None:
        """SGLang's seeded sampler (``--enable-deterministic-inference``) asserts on ``min_p > 0`` and its scheduler
        dies: refused when the endpoint (or a worker behind its router) says it runs one, or cannot say
        (:func:`~paravt_agent.policy.endpoints.deterministic_inference`; an endpoint that is no SGLang server —
        vLLM, a hosted API — has none). Asked once per endpoint until it answers."""
        if self._deterministic is None:
            headers = bearer(self.api_key if self.api_key != "EMPTY" else None)
            self._deterministic = await asyncio.to_thread(_ask_deterministic, self.endpoint, headers)
        refuse_min_p(self.endpoint, min_p, self._deterministic)

    async def aclose(self) -> None:
        await self._clients.aclose(lambda c: c.close())


def _ask_deterministic(endpoint: str, headers: dict) -> bool | None:
    """:func:`~paravt_agent.policy.endpoints.deterministic_inference` of an OpenAI-compatible endpoint's server."""
    import httpx

    with httpx.Client() as client:
        try:
            return deterministic_inference(client, endpoint, headers)
        except PermissionError as exc:
            raise PolicyError(f"{exc}: give the openai backend that key (api_key)") from None
