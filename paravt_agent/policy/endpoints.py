"""What a served endpoint says about itself, a router standing for its workers: the one place the agent's backends
and the trainer's weight syncs ask.

* :func:`router_workers`: an SGLang router (sglang-router: ``GET /workers`` lists them) stands for its workers —
  it forwards generation, not ``/server_info``, pauses or weight updates (0.3.2 answers 404 to those), so what a
  server is asked goes to each worker, at the address the router registered it under.
* :func:`deterministic_inference`: whether SGLang's seeded sampler (``--enable-deterministic-inference``) serves an
  endpoint — it asserts on a request with ``min_p > 0`` and the scheduler dies — as True, False, or None when it
  cannot be told (a router whose worker does not answer: at a loopback address it registered, say). A server that
  is not SGLang (no ``/server_info``, no workers: vLLM, ``transformers serve``) has no such sampler: False.
"""

from __future__ import annotations

from paravt_agent.errors import PolicyError

__all__ = ["bearer", "deterministic_inference", "refuse_min_p", "router_workers"]


def bearer(key: str | None) -> dict[str, str]:
    """The ``Authorization`` header SGLang checks (``--api-key``, ``--admin-api-key``); none without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def router_workers(client, url: str, headers: dict | None = None) -> list[str] | None:
    """The worker URLs an SGLang router lists (``GET /workers``), as it registered them; None when ``url`` is no
    router (a plain server answers 404, or something that is not a list of workers)."""
    try:
        resp = client.get(f"{_base(url)}/workers", headers=headers or {}, timeout=10)
        data = resp.json() if resp.status_code == 200 else {}
    except Exception:  # noqa: BLE001 (a plain server, or one that is down: no workers to stand for)
        return None
    listed = data.get("workers") if isinstance(data, dict) else None
    if isinstance(listed, list) and listed and all(isinstance(w, dict) and w.get("url") for w in listed):
        return list(dict.fromkeys(_base(w["url"]) for w in listed))
    return None


def deterministic_inference(client, url: str, headers: dict | None = None) -> bool | None:
    """Whether ``url`` (a server, or every worker behind a router) samples with SGLang's seeded sampler: True when
    it (or any worker) says so, False when it (and every worker) says not or is no SGLang server, None when it
    cannot be told (a worker that does not answer, a server that errs). A refused key raises PermissionError."""
    url = _base(url)
    try:
        resp = client.get(f"{url}/server_info", headers=headers or {}, timeout=30)
    except Exception:  # noqa: BLE001 (down or unreachable: it cannot say)
        return None
    if resp.status_code in (401, 403):
        raise PermissionError(f"{url}/server_info answered HTTP {resp.status_code}: give the server's --api-key")
    if resp.status_code == 200:
        try:
            data = resp.json()
        except ValueError:
            return None
        return isinstance(data, dict) and data.get("enable_deterministic_inference") is True
    workers = router_workers(client, url, headers)
    if workers is not None:
        answers = [deterministic_inference(client, w, headers) for w in workers]
        if any(a is True for a in answers):
            return True
        return None if any(a is None for a in answers) else False
    return False if resp.status_code == 404 else None


def refuse_min_p(url: str, min_p: float, deterministic: bool | None) -> None:
    """A request with ``min_p > 0`` to a server whose seeded sampler would assert on it (and die), or to one that
    cannot say (a router whose workers do not answer): refused before it is sent, saying what to change."""
    if deterministic is True:
        raise PolicyError(f"{url} runs with deterministic inference (`paravt serve --deterministic`), whose seeded "
                          f"sampler asserts on min_p > 0 inside the scheduler and takes the server down: this "
                          f"request's min_p is {min_p:g}; set min_p 0 in the agent config's sampling, or serve without "
                          "--deterministic")
    if deterministic is None:
        raise PolicyError(f"{url} cannot say whether it (or a worker behind it) runs with deterministic inference, "
                          f"whose seeded sampler dies on min_p > 0 (this request's: {min_p:g}): a router's workers "
                          "must answer /server_info at the address it lists (`paravt serve --dp N --worker-host "
                          "ADDR`); or set min_p 0 in the agent config's sampling")
