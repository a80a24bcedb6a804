"""SGLang's admin HTTP API as the weight syncs use it: server URLs (a router stands for its workers), the keys a
server was started with, what a server says about itself (``GET /server_info``), the pause around an update, the
weight-update session SGLang 0.5.21+ requires around tensor and distributed updates, and the cache flush that
waits for an idle server."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from paravt_agent.errors import ConfigError, PolicyError
from paravt_agent.policy.endpoints import bearer, router_workers

__all__ = ["PAUSE_MODES", "Paused", "ServerFacts", "ServerKeys", "Session", "applied_unflushed", "base_url", "bearer",
           "expand_routers", "finish_unflushed", "flush_when_idle", "json_of", "refused_key", "release_servers",
           "server_facts", "still_paused", "urls_of"]

#: SGLang 0.5.22+'s answer (HTTP 400) to an update whose weights were loaded but whose cache flush was refused
#: because requests ran or waited: the weights and any version it named are applied
UNFLUSHED = "cache was not flushed"

PAUSE_MODES = ("retract", "in_place", "abort")


def base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def urls_of(endpoints: str | Iterable[str]) -> list[str]:
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    return [base_url(e) for e in items]


def json_of(resp) -> dict:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class ServerKeys:
    """The keys a server was started with, as SGLang 0.5.23 checks them (``utils/auth.py``): ``--api-key`` guards
    every route (generation, ``/server_info``); the admin routes (pause, weight updates, flush, LoRA loads) take
    ``--admin-api-key`` when the server has one, else ``--api-key``. A server without keys ignores the header."""

    api_key: str | None = None
    admin_api_key: str | None = None

    @property
    def normal(self) -> dict[str, str]:
        return bearer(self.api_key)

    @property
    def admin(self) -> dict[str, str]:
        return bearer(self.admin_api_key or self.api_key)

    def client(self, timeout: float):
        """An HTTP client that sends the admin key (the syncs' calls are admin calls; the others pass
        :attr:`normal`)."""
        import httpx

        return httpx.Client(timeout=timeout, headers=self.admin)


def refused_key(resp, url: str, what: str) -> None:
    """401/403 from SGLang's key check: a ConfigError naming the settings, never a retried failure."""
    if resp.status_code in (401, 403):
        raise ConfigError(f"{url}{what} answered HTTP {resp.status_code}: the server was started with --api-key "
                          "or --admin-api-key; name the environment variables holding them with sync.api_key_env "
                          "and sync.admin_api_key_env")


@dataclass(frozen=True)
class ServerFacts:
    """What one SGLang server says about itself at ``GET /server_info`` (its resolved server arguments): None
    where it says nothing (a server that does not answer the route, or an older release)."""

    url: str
    tp_size: int | None = None
    dp_size: int | None = None
    pp_size: int | None = None
    deterministic: bool | None = None
    #: ``SGLANG_VLM_CACHE_SIZE_MB`` as the server reports it (``internal_states[i].env_vars``, which SGLang fills,
    #: with the variables that are set, only under ``SGLANG_EXPOSE_OWN_ENV_VARS=1``: ``paravt serve`` sets it; a
    #: listing without it is SGLang's default, 100 MB); None when it does not say
    vlm_cache_mb: int | None = None


def _int(value) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


#: SGLang 0.5.23's vision-feature cache when ``SGLANG_VLM_CACHE_SIZE_MB`` is unset (``environ.py``: EnvInt(100))
SGLANG_DEFAULT_VLM_CACHE_MB = 100


def server_facts(client, url: str, keys: ServerKeys | None = None) -> ServerFacts:
    """``GET /server_info`` (the deprecated ``/get_server_info`` on 404) of one server, read into
    :class:`ServerFacts`. A server that does not answer it gives facts of None; one that refuses the key raises."""
    keys = keys or ServerKeys()
    data: dict = {}
    for route in ("/server_info", "/get_server_info"):
        try:
            resp = client.get(f"{url}{route}", headers=keys.normal, timeout=30)
        except Exception:  # noqa: BLE001 (a server that cannot answer is reported by the update that follows)
            break
        refused_key(resp, url, route)
        if resp.status_code == 200:
            data = json_of(resp)
            break
        if resp.status_code != 404:
            break
    cache = None
    for state in data.get("internal_states") or []:
        env = state.get("env_vars") if isinstance(state, dict) else None
        if isinstance(env, dict):  # SGLang lists the variables that are set: unset is its default cache
            cache = _int(env.get("SGLANG_VLM_CACHE_SIZE_MB", SGLANG_DEFAULT_VLM_CACHE_MB))
            break
    deterministic = data.get("enable_deterministic_inference")
    return ServerFacts(url=url, tp_size=_int(data.get("tp_size")), dp_size=_int(data.get("dp_size")),
                       pp_size=_int(data.get("pp_size")),
                       deterministic=deterministic if isinstance(deterministic, bool) else None,
                       vlm_cache_mb=cache)


def expand_routers(client, urls: list[str], keys: ServerKeys | None = None) -> list[str]:
    """Each URL, or the workers behind it when it is an SGLang router
    (:func:`~paravt_agent.policy.endpoints.router_workers`): the router forwards generation but not weight updates,
    so every worker is updated directly, at the address it was registered under (`paravt serve --dp N
    --worker-host ADDR` registers one other hosts reach). Asked at each push, so workers added later are updated
    too."""
    out: list[str] = []
    headers = (keys or ServerKeys()).normal
    for url in urls:
        for w in router_workers(client, url, headers) or [url]:
            if w not in out:
                out.append(w)
    return out


class Paused:
    """``/pause_generation {"mode": mode}`` on enter, ``/continue_generation`` on exit (even after a failure)."""

    def __init__(self, client, url: str, mode: str):
        self.client, self.url, self.mode = client, url, mode

    def __enter__(self):
        resp = self.client.post(f"{self.url}/pause_generation", json={"mode": self.mode})
        refused_key(resp, self.url, "/pause_generation")
        resp.raise_for_status()
        return self

    def __exit__(self, *exc):
        resp = self.client.post(f"{self.url}/continue_generation", json={})
        if exc[0] is None:  # while another error unwinds, that one is the one to report
            resp.raise_for_status()
        return False


def flush_when_idle(client, url: str, timeout: float = 60.0, log=None) -> bool:
    """Flush the radix cache once the server is idle: after an ``in_place`` update it still holds prefixes computed
    with the old weights. SGLang refuses a flush while requests run or wait; ``POST /flush_cache?timeout=T``
    (0.5.22+) makes the server wait up to ``T`` seconds for idle and flush then. A server that stays busy that
    long keeps the old prefixes: requests that share one reuse its old-weight KV cache until the next flush (the
    next sync's), and this says so and returns False. A release without the parameter answers at once: it is
    asked again every half second until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        t0 = time.monotonic()
        resp = client.post(f"{url}/flush_cache", params={"timeout": round(left, 1)}, timeout=left + 30)
        if resp.status_code == 200:
            return True
        if "already in progress" in resp.text:  # another client's deferred flush will do it (or time out too)
            return True
        waited = time.monotonic() - t0
        if time.monotonic() >= deadline or waited >= left * 0.5:
            (log or print)(f"warning: {url} was never idle for {timeout:g}s after an in_place weight update "
                           f"({resp.text.strip()[:120]}); its cache keeps prefixes computed with the old weights, "
                           "which requests sharing them reuse until the next flush")
            return False
        time.sleep(0.5)  # an SGLang before 0.5.22 ignored the timeout and refused at once


class Session:
    """``/begin_weight_update`` on enter and ``/end_weight_update`` on exit (even after a failure): the session
    SGLang 0.5.21+ requires around tensor and distributed updates. A server without the routes (404: an older
    SGLang) is updated without one; a session left open by a trainer that died is closed and opened again."""

    def __init__(self, client, url: str):
        self.client, self.url, self.open = client, url, False

    def _begin(self):
        return self.client.post(f"{self.url}/begin_weight_update", json={"selector": "all"})

    def __enter__(self):
        resp = self._begin()
        if resp.status_code == 404:
            return self
        if resp.status_code == 400 and "already open" in resp.text:
            self.client.post(f"{self.url}/end_weight_update", json={})
            resp = self._begin()
        data = json_of(resp)
        if resp.status_code != 200 or not data.get("success", False):
            raise PolicyError(f"{self.url}/begin_weight_update refused: {data.get('message') or resp.text[:300]}")
        self.open = True
        return self

    def __exit__(self, *exc):
        if self.open:
            resp = self.client.post(f"{self.url}/end_weight_update", json={})
            data = json_of(resp)
            if exc[0] is None and (resp.status_code != 200 or not data.get("success", False)):
                raise PolicyError(f"{self.url}/end_weight_update refused: {data.get('message') or resp.text[:300]}")
        return False




def release_servers(urls: list[str], keys: ServerKeys | None = None, timeout: float = 60.0) -> tuple[list, list]:
    """What a push that never ended left on its servers, undone: generation continued (``/continue_generation``)
    and a weight-update session closed (``/end_weight_update``: 400 when none is open, 404 before 0.5.21), on each
    server (a router's workers). Returns ``(servers released, errors)``; a router that is down is an error (its
    workers are unknown), never an exception."""
    import httpx

    keys = keys or ServerKeys()
    done, errors = [], []
    with keys.client(timeout) as client:
        try:
            targets = expand_routers(client, urls, keys) if urls else []
        except Exception as exc:  # noqa: BLE001 (said; the push of the serving version that follows reports a dead one)
            return [], [f"{urls}: {exc}"]
        for url in targets:
            try:
                resp = client.post(f"{url}/continue_generation", json={})
                client.post(f"{url}/end_weight_update", json={})
            except httpx.HTTPError as exc:
                errors.append(f"{url}: {exc}")
                continue
            (done if resp.status_code == 200 else errors).append(
                url if resp.status_code == 200 else f"{url}: HTTP {resp.status_code}")
    return done, errors


def applied_unflushed(resp) -> bool:
    """An update SGLang applied but could not flush after (HTTP 400 "Weights were updated, but the cache was not
    flushed…": requests ran, e.g. a pause someone else ended): not a failed push."""
    return resp.status_code == 400 and UNFLUSHED in (json_of(resp).get("message") or resp.text or "")


def still_paused(client, url: str, keys: ServerKeys | None = None) -> bool:
    """Whether ``url`` is still paused (SGLang 0.5.23: ``/ready`` answers 503 while paused, 200 once generation
    runs): a pause ended by someone else (the pause supervisor's ``--max-pause``) reads False. A server that
    cannot say (no ``/ready``, down) reads True: nothing to act on."""
    try:
        return client.get(f"{url}/ready", headers=(keys or ServerKeys()).normal, timeout=10).status_code != 200
    except Exception:  # noqa: BLE001 (cannot say: act as before)
        return True


def served_version(client, url: str, keys: ServerKeys | None = None) -> str | None:
    """The weight version ``url`` answers under (``/model_info``), None when it does not say."""
    try:
        return json_of(client.get(f"{url}/model_info", headers=(keys or ServerKeys()).normal, timeout=10)).get(
            "weight_version")
    except Exception:  # noqa: BLE001 (said as unknown)
        return None


def finish_unflushed(client, url: str, version: str | None, log=print, flushed: bool = False) -> dict:
    """After an update applied while generation ran (a pause ended mid-push): the radix cache flushed once the
    server is idle (:func:`flush_when_idle`), then — only then — the version named (``/update_weight_version``),
    so no reply reports the new version while old-weight prefixes are still cached; a server that stayed busy
    keeps its old version's name (said: its replies are then a mix under the old name until the next push's
    flush). Returns what happened."""
    flushed = flushed or flush_when_idle(client, url, log=log)
    named = None
    if version is not None and not flushed:
        log(f"warning: {url} holds version {version}'s weights but its cache could not be flushed (busy): its "
            "replies keep the older version's name until a flush; the next push flushes it")
    elif version is not None:
        resp = client.post(f"{url}/update_weight_version", json={"new_version": str(version),
                                                                 "abort_all_requests": False})
        refused_key(resp, url, "/update_weight_version")
        named = str(version) if resp.status_code == 200 and json_of(resp).get("success", True) else None
    return {"success": True, "applied": True, "flushed": flushed, "weight_version": named}
