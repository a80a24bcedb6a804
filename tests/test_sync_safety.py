"""What keeps a weight push, a rollout request or a server launch from taking an SGLang server down (issue #54): a
scheduler exception kills SGLang, and every request in flight with it. Each case against the SGLang stand-in
(``tests/sglang_server.py``, which exits where SGLang's scheduler would), a recording JSON server, or a group that
blocks; one against SGLang 0.5.23 itself. The cases only a GPU shows (CUDA-IPC handles, NCCL) have structural
tests here and CUDA tests that skip without one (the GPU runner's)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from paravt_agent.errors import ConfigError, PolicyError
from paravt_agent.types import Sampling
from paravt_train.sync import checks
from paravt_train.sync.disk import SGLangWeightSync
from paravt_train.sync.distributed import SGLangDistributedSync
from paravt_train.sync.http import ServerKeys, server_facts
from paravt_train.sync.streamed import SGLangTensorSync
from tests.conftest import free_port, rendezvous_port, require_contract

ROOT = Path(__file__).resolve().parents[1]


class StandIn:
    """The SGLang stand-in with the flags these tests need (TP/DP sizes, keys), as a subprocess."""

    def __init__(self, model: str, *flags: str, env: dict | None = None):
        require_contract()
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "sglang_server.py"), "--model", model, "--port", port, *flags],
            env={**os.environ, "SGLANG_STUB_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()[-2000:]
            try:
                httpx.get(self.url + "/health", timeout=2)
                return
            except httpx.HTTPError:
                assert time.time() < deadline, "the stand-in did not start"
                time.sleep(0.3)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def info(self, key: str | None = None) -> dict:
        return httpx.get(self.url + "/server_info", headers=ServerKeys(key).normal, timeout=30).json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def stand_in():
    started: list[StandIn] = []

    def start(model: str, *flags: str, env: dict | None = None) -> StandIn:
        started.append(StandIn(model, *flags, env=env))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _model(tiny_model):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)


# --------------------------------------------------------------------------------------------- TP and DP


def test_the_syncs_take_tp_and_dp_from_each_server(tiny_model, stand_in, json_server):
    """A server started with --tp 2 (the stand-in reports tp_size 2 at /server_info, as SGLang's resolved arguments
    do): a tensor push carries one payload per TP rank of *that server* whatever ``sglang_tp_size`` says (before,
    the config's 1: SGLang's tp_worker indexed past the list and the scheduler died — the stand-in exits likewise;
    a config of 4 sent two payloads that were never opened, a model copy leaked per push on a GPU); a distributed
    push joins a group of 1 + 2 ranks (before, world_size 2: the server's second rank fell outside and the join
    failed). A data-parallel server is refused before anything is paused (SGLang refuses both updates at dp > 1)."""
    srv = stand_in(tiny_model, "--tp-size", "2",
                   env={"SGLANG_EXPOSE_OWN_ENV_VARS": "1", "SGLANG_VLM_CACHE_SIZE_MB": "0"})
    with httpx.Client() as c:
        facts = server_facts(c, srv.url)
    assert (facts.tp_size, facts.dp_size, facts.deterministic, facts.vlm_cache_mb) == (2, 1, False, 0)
    model = _model(tiny_model)
    with torch.no_grad():
        next(iter(model.parameters())).add_(0.5)
    for configured in (None, 1, 4):
        SGLangTensorSync(srv.url, tp_size=configured, bucket_bytes=4 << 20).push(model, version=f"t{configured}")
        assert srv.alive(), srv.proc.stderr.read()[-2000:]
    assert srv.info()["tensor_payloads"][-1] == 2 and set(srv.info()["tensor_payloads"]) == {2}
    sync = SGLangDistributedSync(srv.url, master_port=rendezvous_port(), backend="gloo", device="cpu", timeout=60,
                                 bucket_bytes=4 << 20)
    try:
        sync.push(model, version="d1")
    finally:
        sync.close()
    assert httpx.get(srv.url + "/model_info", timeout=30).json()["weight_version"] == "d1" and srv.alive()

    dp = json_server(lambda path, body: (200, {"tp_size": 1, "dp_size": 2}) if path == "/server_info"
                     else (200, {"success": True}))
    for make in (lambda: SGLangTensorSync(dp.url), lambda: SGLangDistributedSync(dp.url, backend="gloo")):
        with pytest.raises(ConfigError, match="dp_size 2.*--dp N"):
            make().send_tensors([("w", torch.zeros(2))])
    assert [p for p in dp.paths if p != "/workers"] == ["/server_info", "/server_info"]  # nothing paused


# ---------------------------------------------------------------------------------------- CUDA-IPC reach

SERVER_SCRIPT = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        print(self.path, flush=True)
        raw = json.dumps({"success": True, "tp_size": 1, "dp_size": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def gpu_server():
    """A server process with the CUDA_VISIBLE_DEVICES it is given, answering every route with success (and printing
    each path it was asked): what the tensor sync's reach check reads is the real process's environment."""
    procs = []

    def start(visible: str | None):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(port)], env=env, stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.time() < deadline and proc.poll() is None
                time.sleep(0.1)
        return url, proc

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def _paths(proc) -> list[str]:
    proc.kill()
    proc.wait(10)
    return [line.strip() for line in proc.stdout.read().splitlines()]


def test_a_tensor_push_from_a_gpu_the_server_cannot_see_is_refused(gpu_server, monkeypatch, tmp_path):
    """docs/training.md's layout (the server on one GPU, the trainer on others) with sync.via tensor: SGLang cannot
    open a CUDA-IPC handle of a GPU it does not see, outside any try ("Invalid device_uuid"), and the whole server
    died on the first bucket. "The same GPU" is decided by UUID, never by CUDA_VISIBLE_DEVICES strings: two Slurm
    tasks both call their own GPU "0" (the old string compare pushed, and killed the server), a ``docker --gpus``
    server has no variable at all (the old check took that as "every GPU"). The server's GPUs come from the record
    ``paravt serve`` keeps, else from NVML's view of its processes; unknown is refused, before anything is paused.
    No GPU here: the sending GPU is faked, the server processes, records and the nvidia-smi they ask are real."""
    from paravt_agent.serving import fleet

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the records of this test only
    ours, theirs = "GPU-5a1e0000-1111-2222-3333-444455556666", "GPU-77770000-1111-2222-3333-444455556666"
    sender = checks.SenderGPU(entry="0", uuid=ours)  # a Slurm task's GPU "0"
    monkeypatch.setattr(checks, "sending_gpu", lambda device: sender if getattr(device, "type", None) == "cuda"
                        else None)
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ["PATH"])  # no nvidia-smi yet

    def push(url):
        SGLangTensorSync(url, source_device=torch.device("cuda", 0), log=lambda m: None).send_tensors(
            [("w", torch.zeros(4))], version="1")

    # Slurm: the server's task also calls its GPU "0", another GPU (its UUID differs): refused
    url, proc = gpu_server("0")
    fleet.record_gpus(int(url.rsplit(":", 1)[1]), proc.pid, [theirs])
    with pytest.raises(ConfigError, match=f"GPU {ours}.*whose GPUs are {theirs}.*Invalid device_uuid.*distributed"):
        push(url)
    asked = _paths(proc)
    assert "/pause_generation" not in asked and "/update_weights_from_tensor" not in asked

    # the same record naming our GPU (by UUID, whatever index the server's process calls it): pushed to
    url, proc = gpu_server("3")
    fleet.record_gpus(int(url.rsplit(":", 1)[1]), proc.pid, [theirs, ours])
    push(url)
    assert "/update_weights_from_tensor" in _paths(proc)

    # docker --gpus: no variable, no record, no NVML here: cannot be told, refused (was: pushed)
    url, proc = gpu_server(None)
    with pytest.raises(ConfigError, match="cannot be told here.*not started by `paravt serve`.*NVML"):
        push(url)
    assert "/pause_generation" not in _paths(proc)

    # a record left by an earlier server on the port is no answer for a new process there
    url, proc = gpu_server(None)
    fleet.record_gpus(int(url.rsplit(":", 1)[1]), proc.pid + 10_000_000, [ours])
    with pytest.raises(ConfigError, match="cannot be told"):
        push(url)
    proc.kill()

    # NVML's view of the server's processes (nvidia-smi --query-compute-apps), the driver's own answer
    url, proc = gpu_server(None)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(f"#!/bin/sh\necho '{proc.pid + 1}, {ours}'\necho '{proc.pid}, {theirs}'\n")
    smi.chmod(0o755)
    with pytest.raises(ConfigError, match=f"whose GPUs are {theirs} \\(the GPUs NVML shows"):
        push(url)
    smi.write_text(f"#!/bin/sh\necho '{proc.pid}, {ours}'\n")
    push(url)
    assert "/update_weights_from_tensor" in _paths(proc)

    with pytest.raises(ConfigError, match="another host.*sync.via distributed"):
        checks.refuse_unreachable_ipc("http://192.0.2.7:30000", torch.device("cuda", 0), set())
    checks.refuse_unreachable_ipc("http://192.0.2.7:30000", torch.device("cpu"), set())  # by value: any host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU runner's case)")
def test_a_tensor_push_from_a_gpu_the_server_cannot_see_is_refused_on_cuda(gpu_server, monkeypatch, tmp_path):
    """The same on a GPU, nothing faked but the server: the sending GPU's UUID from CUDA; a server process that
    sees no GPU (CUDA_VISIBLE_DEVICES='', no CUDA context for NVML to show) refused before any pause; one whose
    record (as `paravt serve` writes it from the GPUs its environment shows) names the GPU by UUID pushed to."""
    from paravt_agent.serving import fleet

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sender = checks.sending_gpu(torch.device("cuda", 0))
    assert sender is not None and sender.uuid.startswith("GPU-")
    assert sender.uuid in fleet.visible_gpu_uuids()
    url, proc = gpu_server("")
    with pytest.raises(ConfigError, match="Invalid device_uuid"):
        SGLangTensorSync(url, source_device=torch.device("cuda", 0)).send_tensors([("w", torch.zeros(4))], "1")
    assert "/pause_generation" not in _paths(proc)
    url, proc = gpu_server(sender.uuid)
    fleet.record_gpus(int(url.rsplit(":", 1)[1]), proc.pid, fleet.visible_gpu_uuids())
    SGLangTensorSync(url, source_device=torch.device("cuda", 0)).send_tensors([("w", torch.zeros(4))], "1")
    assert "/update_weights_from_tensor" in _paths(proc)


# ------------------------------------------------------------------------------------ NCCL: a group that blocks


class BlockingGroup:
    """A weight-update group whose first collective blocks, as NCCL's does while it connects to ranks that never
    come (a server that refused the bucket); ``abort()`` ends it, as NCCL's communicator abort does."""

    def __init__(self):
        self.aborted = threading.Event()

    def abort(self):
        self.aborted.set()


def test_a_refused_first_bucket_does_not_hang_the_trainer(json_server, monkeypatch):
    """NCCL connects a group at its first collective and waits there, with no timeout, for every rank. The
    broadcasts ran on the trainer's main thread before it looked at the server's answer, so a server that
    refused bucket 1 (its out-of-memory allocating the receive buffers) left the trainer blocked for good. Now
    they run on a worker thread: the refusal is seen, the group aborted, the push fails at once, the server
    leaves its group, its session is closed and generation goes on; a bucket that never arrives ends at the
    deadline the same way."""
    import torch.distributed as dist

    group = BlockingGroup()
    calls = []

    def broadcast(tensor, group=None, group_src=None, async_op=False, **kw):  # NCCL's first call: connect, wait
        calls.append(tensor.shape)
        group.aborted.wait()
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(dist, "broadcast", broadcast)
    state = {"refuse": True}

    def reply(path, body):
        if path == "/update_weights_from_distributed":
            if state["refuse"]:
                return 400, {"success": False, "message": "Failed to update weights: CUDA out of memory"}
            time.sleep(0.2)
            return 200, {"success": True, "message": "ok"}
        if path == "/server_info":
            return 200, {"tp_size": 1, "dp_size": 1}
        return 200, {"success": True, "message": "ok", "status": "ok"}

    srv = json_server(reply)
    for refuse, timeout, expected in ((True, 30, "refused bucket 1.*out of memory"),
                                      (False, 1.5, "bucket 1 was not received .* within 1.5s")):
        state["refuse"] = refuse
        group.aborted.clear()
        sync = SGLangDistributedSync(srv.url, backend="nccl", timeout=timeout, bucket_bytes=1 << 20)
        sync.groups[srv.url], sync.names[srv.url] = group, "paravt_weight_sync"  # joined earlier
        out: dict = {}

        def push(sync=sync, out=out):
            try:
                sync.send_tensors([("w", torch.zeros(8)), ("b", torch.zeros(2))], version="1")
            except Exception as exc:  # noqa: BLE001 (inspected below)
                out["error"] = exc

        t = threading.Thread(target=push, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(20)
        try:
            assert not t.is_alive(), "the trainer is still blocked in the group's first broadcast"
        finally:
            group.aborted.set()  # releases a blocked thread either way
        assert time.monotonic() - t0 < timeout + 10
        assert isinstance(out.get("error"), PolicyError) and __import__("re").search(expected, str(out["error"]))
        assert group.aborted.is_set() and sync.groups == {}
        # the next join rendezvouses on another port: a group an abort could not end (NCCL still connecting) keeps
        # its store's port
        assert sync.port_of(srv.url, 0) == sync.master_port + 100
        tail = [p for p in srv.paths if p not in ("/server_info", "/workers")][-3:]
        assert tail == ["/end_weight_update", "/continue_generation", "/destroy_weights_update_group"]
        assert calls


@pytest.mark.timeout(90)  # a hang here must not eat the GPU runner's time
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and NCCL (the GPU runner's case)")
def test_a_refused_first_bucket_does_not_hang_the_trainer_on_nccl(json_server):
    """The same with NCCL itself on one GPU: a real group whose other rank (a server's, in another process) joins
    the rendezvous but never broadcasts, and a server that refuses bucket 1: the push fails within seconds and the
    group is aborted."""
    from paravt_train.sync.distributed import init_weight_update_group

    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from paravt_train.sync.distributed import init_weight_update_group; "
        f"init_weight_update_group('127.0.0.1', {port}, 1, 2, 'g', 'nccl', 60); time.sleep(120)")])
    try:
        srv = json_server(lambda path, body: (400, {"success": False, "message": "CUDA out of memory"})
                          if path == "/update_weights_from_distributed" else
                          (200, {"tp_size": 1, "dp_size": 1, "success": True}))
        sync = SGLangDistributedSync(srv.url, backend="nccl", timeout=60)
        sync.groups[srv.url] = init_weight_update_group("127.0.0.1", port, 0, 2, "g", "nccl", 60)
        sync.names[srv.url] = "g"
        t0 = time.monotonic()
        with pytest.raises(PolicyError, match="refused bucket 1"):
            sync.send_tensors([("w", torch.zeros(8, device="cuda"))], version="1")
        assert time.monotonic() - t0 < 30 and sync.groups == {}
    finally:
        peer.kill()


# ------------------------------------------------------------------------------ min_p and deterministic inference


def test_min_p_on_a_deterministic_server_is_refused_not_sent(tiny_model, sglang_stub, json_server):
    """SGLang's seeded sampler (``paravt serve --deterministic``) asserts on min_p > 0 inside the scheduler, which
    takes the server down (the stand-in exits likewise). The sglang backend now asks the server once
    (/server_info) and refuses such a request with an error saying what to change; the GRPO run refuses such an
    agent config before its first request. A server without deterministic inference takes min_p."""
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.sglang_backend import SGLangPolicy
    from paravt_train.rl.config import check_served_sampling

    stub = sglang_stub(tiny_model)  # --enable-deterministic-inference
    pol = SGLangPolicy(tiny_model, stub.url)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "red green"}]}]
    with pytest.raises(PolicyError, match="deterministic inference.*min_p is 0.1.*set min_p 0"):
        asyncio.run(pol.generate(msgs, Sampling(temperature=1.0, min_p=0.1, max_new_tokens=2)))
    assert stub.proc.poll() is None, "the server died"
    assert len(asyncio.run(pol.generate(msgs, Sampling(temperature=1.0, max_new_tokens=2))).output_ids) == 2
    cfg = AgentConfig()
    eval_cfg = cfg.model_copy(update={"planner_sampling": cfg.planner_sampling.model_copy(update={"min_p": 0.05})})
    with pytest.raises(ConfigError, match=r"planner_sampling\.min_p = 0\.05"):
        check_served_sampling(pol, cfg, eval_cfg)
    check_served_sampling(pol, cfg)  # no min-p anywhere: nothing to ask
    plain = json_server(lambda path, body: (200, {"enable_deterministic_inference": False}))
    check_served_sampling(SGLangPolicy(tiny_model, plain.url), cfg, eval_cfg)


def _router(workers: list[str], tmp_path, api_key: str | None = None):
    """sglang-router 0.3.2 (the real one) in front of ``workers``, once it lists them all: (url, process)."""
    from tests.conftest import engine_unavailable
    from tests.sglang_cpu.server import PYTHON, unavailable

    engine_unavailable(unavailable())
    port = free_port()
    log = tmp_path / f"router-{port}.log"
    with log.open("w") as f:
        proc = subprocess.Popen([str(PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                                 str(port), "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
                                 "--worker-urls", *workers,
                                 *(["--api-key", api_key] if api_key else [])],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            listed = httpx.get(url + "/workers", timeout=2, headers={"Authorization": f"Bearer {api_key}"}
                               if api_key else {}).json()["workers"]
            if sorted(w["url"] for w in listed) == sorted(workers):
                return url, proc
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.3)


def test_the_min_p_guard_asks_a_routers_workers_and_refuses_when_it_cannot_tell(tiny_model, sglang_stub, tmp_path,
                                                                               json_server):
    """sglang-router 0.3.2 answers /server_info with 404, so the guard used to read "not deterministic" and a
    min_p request reached a --deterministic worker, which died. Now the guard asks the router's workers
    (``GET /workers``, then each one's /server_info) and refuses a min_p request when any says so, or when one
    cannot be asked (a worker that does not answer at the address the router lists); the OpenAI backend, which
    sent min_p with no guard at all, asks the same way. Real router, stand-in workers (SGLang's API)."""
    from paravt_agent.policy.openai_backend import OpenAIPolicy
    from paravt_agent.policy.sglang_backend import SGLangPolicy

    det, plain = sglang_stub(tiny_model), sglang_stub(tiny_model, deterministic=False)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "red green"}]}]
    min_p = Sampling(temperature=1.0, min_p=0.1, max_new_tokens=2)
    router, proc = _router([det.url, plain.url], tmp_path)
    try:
        assert httpx.get(router + "/server_info", timeout=10).status_code == 404  # why the guard was blind
        with pytest.raises(PolicyError, match="deterministic inference.*min_p is 0.1"):
            asyncio.run(SGLangPolicy(tiny_model, router).generate(msgs, min_p))
        with pytest.raises(PolicyError, match="deterministic inference.*min_p is 0.1"):
            asyncio.run(OpenAIPolicy("m", router + "/v1").generate(msgs, min_p))
        assert det.proc.poll() is None and plain.proc.poll() is None, "a worker died"
        det.close()  # listed by the router, not answering: cannot tell
        with pytest.raises(PolicyError, match="cannot say whether it \\(or a worker behind it\\)"):
            asyncio.run(SGLangPolicy(tiny_model, router).generate(msgs, min_p))
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(10)
    router, proc = _router([plain.url], tmp_path)  # every worker says no: min_p goes through
    try:
        assert len(asyncio.run(SGLangPolicy(tiny_model, router).generate(msgs, min_p)).output_ids) == 2
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(10)
    chat = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}
    for answer in (False, True):  # an OpenAI-compatible SGLang server, asked once
        srv = json_server(lambda path, body, a=answer: (200, {"enable_deterministic_inference": a})
                          if path == "/server_info" else (200, chat))
        pol = OpenAIPolicy("m", srv.url + "/v1")
        for _ in range(2):
            if answer:
                with pytest.raises(PolicyError, match="deterministic inference"):
                    asyncio.run(pol.generate(msgs, min_p))
            else:
                assert asyncio.run(pol.generate(msgs, min_p)).text == "ok"
        assert [p for _, p, _ in srv.seen].count("/server_info") == 1
        sent = [b.get("min_p") for _, p, b in srv.seen if p.endswith("/chat/completions")]
        assert sent == ([] if answer else [0.1, 0.1])
    hosted = json_server(lambda path, body: (404, {"error": "not found"}) if "chat" not in path else (200, chat))
    assert asyncio.run(OpenAIPolicy("m", hosted.url + "/v1").generate(msgs, min_p)).text == "ok"  # no SGLang: sent


# ------------------------------------------------------------------------------------------------ API keys


def test_a_server_started_with_api_keys_is_reached(tiny_model, stand_in, monkeypatch, tmp_path):
    """A server started with --api-key and --admin-api-key (SGLang answers 401 without them): the sglang backend
    sends its key on generation (the factory used to drop it), the syncs send the admin key on the admin routes
    and the API key on /server_info. The keys come from environment variables the config names; a missing key
    is a ConfigError naming the settings, not a retried failure."""
    from paravt_agent.policy.registry import make_policy, make_rollout_policy
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.sync import server_keys

    srv = stand_in(tiny_model, "--api-key", "user-key", "--admin-api-key", "admin-key")
    assert httpx.get(srv.url + "/server_info", timeout=30).status_code == 401
    msgs = [{"role": "user", "content": [{"type": "text", "text": "red green"}]}]
    s = Sampling(temperature=0.0, max_new_tokens=2)
    for pol in (make_policy("sglang", tiny_model, srv.url, api_key="user-key"),
                make_rollout_policy("sglang", tiny_model, srv.url, api_key="user-key")):
        assert len(asyncio.run(pol.generate(msgs, s)).output_ids) == 2
    with pytest.raises(PolicyError, match="401.*--api-key"):
        asyncio.run(make_policy("sglang", tiny_model, srv.url).generate(msgs, s))

    monkeypatch.setenv("SRV_KEY", "user-key")
    monkeypatch.setenv("SRV_ADMIN_KEY", "admin-key")
    cfg = GRPOConfig(model=tiny_model, sync={"api_key_env": "SRV_KEY", "admin_api_key_env": "SRV_ADMIN_KEY"})
    keys = server_keys(cfg)
    assert (keys.api_key, keys.admin_api_key, cfg.sync.api_key()) == ("user-key", "admin-key", "user-key")
    SGLangWeightSync(srv.url, tmp_path, keys=keys).serve(tiny_model, version="k1")
    SGLangTensorSync(srv.url, keys=keys, bucket_bytes=64 << 20).push(_model(tiny_model), version="k2")
    assert srv.info("user-key")["tp_size"] == 1
    assert httpx.get(srv.url + "/model_info", headers=keys.normal, timeout=30).json()["weight_version"] == "k2"
    for wrong in (ServerKeys(), ServerKeys("user-key")):  # no key; the API key where the admin key is required
        with pytest.raises(ConfigError, match="401.*sync.api_key_env"):
            SGLangWeightSync(srv.url, tmp_path, keys=wrong).serve(tiny_model, version="x")
    monkeypatch.delenv("SRV_KEY")
    with pytest.raises(ConfigError, match="SRV_KEY, which is not set"):
        cfg.sync.api_key()
    assert srv.alive()


# ------------------------------------------------------------------------------------------ the launcher


def test_the_launcher_serves_the_trainers_lora_modules_and_leaves_the_cache_to_sglang(tmp_path):
    """``--lora-target-modules all`` also adapted embed_tokens and lm_head, which the trainer never trains: the
    launcher now names the trainer's modules (its defaults, or a run's own, with the rank, from the run's config
    or adapter directory); modules SGLang cannot serve are refused at once. The vision-feature cache is SGLang's
    own choice unless asked (0 for RL servers), and every server reports it at /server_info
    (SGLANG_EXPOSE_OWN_ENV_VARS), which the syncs read."""
    import json

    from paravt_agent.serving.sglang_launch import LORA_TARGET_MODULES, lora_of_run, sglang_command
    from paravt_train.infra.lora import LoraSettings

    assert list(LORA_TARGET_MODULES) == LoraSettings().target_modules  # the trainer's defaults, one list
    argv, env = sglang_command("m", lora_rank=16)
    line = " ".join(argv)
    assert "--max-lora-rank 16 --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj " \
           "--max-loras-per-batch 3" in line
    assert " all" not in line and "embed_tokens" not in line and "lm_head" not in line
    run = tmp_path / "grpo.yaml"
    run.write_text("model: m\nlora:\n  enabled: true\n  r: 8\n  target_modules: [q_proj, v_proj]\n")
    assert lora_of_run(run) == (8, ["q_proj", "v_proj"])
    line = " ".join(sglang_command("m", lora_from=run, device="cpu")[0])
    assert "--max-lora-rank 8 --lora-target-modules q_proj v_proj --max-loras-per-batch 3 --lora-backend " \
           "torch_native" in line
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 32, "target_modules": ["o_proj", "down_proj"]}))
    assert "--max-lora-rank 32 --lora-target-modules o_proj down_proj" in " ".join(
        sglang_command("m", lora_from=adapter)[0])
    with pytest.raises(ValueError, match="below the rank 32"):
        sglang_command("m", lora_from=adapter, lora_rank=16)
    with pytest.raises(ValueError, match="cannot serve LoRA adapters on qkv, proj"):
        sglang_command("m", lora_rank=8, lora_target_modules=["q_proj", "qkv", "proj"])
    run.write_text("model: m\nlora:\n  r: 8\n")
    with pytest.raises(ValueError, match="does not train LoRA"):
        lora_of_run(run)
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in env and env["SGLANG_EXPOSE_OWN_ENV_VARS"] == "1"
    assert sglang_command("m", vlm_cache_mb=0)[1]["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    assert sglang_command("m", vlm_cache_mb=100)[1]["SGLANG_VLM_CACHE_SIZE_MB"] == "4096"


def test_a_vision_tower_push_warns_unless_the_server_reports_its_cache_off(tiny_model, json_server, tmp_path):
    """SGLang keeps its vision-feature cache across weight updates: a run that trains the vision tower warns,
    once per server, when a server does not report the cache off (reported by `paravt serve` servers through
    SGLANG_EXPOSE_OWN_ENV_VARS); a run that leaves the tower frozen (LoRA on the language model) does not."""
    from paravt_train.infra import lora
    from paravt_train.infra.lora import LoraSettings
    from paravt_train.sync import trains_vision_tower

    def server(cache):  # "unset": listed variables without it (SGLang's default, 100 MB); None: no listing at all
        env = {} if cache in (None, "unset") else {"SGLANG_VLM_CACHE_SIZE_MB": cache}
        state = {} if cache is None else {"env_vars": env}
        return json_server(lambda path, body: (200, {"internal_states": [state], "tp_size": 1})
                           if path == "/server_info" else (200, {"success": True, "message": "ok"}))

    model = _model(tiny_model)
    assert trains_vision_tower(model)
    assert not trains_vision_tower(lora.wrap(_model(tiny_model), LoraSettings(enabled=True)))
    for cache, warned in ((None, True), ("unset", True), ("100", True), ("0", False)):
        srv, log = server(cache), []
        tensor = SGLangTensorSync(srv.url, vision_trained=True, log=log.append)
        for _ in range(2):
            tensor.send_tensors([("w", torch.zeros(2))])
        sync = SGLangWeightSync(srv.url, tmp_path, vision_trained=True, log=log.append)
        sync.serve(tmp_path)
        sync.serve(tmp_path)
        hits = [m for m in log if "vision-feature cache" in m]
        assert len(hits) == (2 if warned else 0), log  # once per sync and server, never per push
        if warned:
            assert "--vlm-cache-mb 0" in hits[0] and ("100 MB" in hits[0]) == (cache in ("100", "unset"))
            assert ("does not report" in hits[0]) == (cache is None)
        log.clear()
        SGLangTensorSync(srv.url, vision_trained=False, log=log.append).send_tensors([("w", torch.zeros(2))])
        assert not [m for m in log if "vision" in m]


# --------------------------------------------------------------------------------------------- CI and install


def test_ci_fails_instead_of_skipping_when_the_real_engine_is_missing(monkeypatch):
    """A failed `make sglang-cpu` (a transient registry error) printed a warning and every real-engine test
    skipped: CI went green with none of them. .ci/run now sets PARAVT_REQUIRE_ENGINES=1 (and still runs the
    README's `make test`), under which the real-engine fixtures fail; locally they skip, saying why."""
    from tests.conftest import engine_unavailable

    ci = (ROOT / ".ci" / "run").read_text()
    assert ("export PARAVT_REQUIRE_ENGINES=1" in ci
            and ci.index("export PARAVT_REQUIRE_ENGINES") < ci.index("\nmake test"))
    engine_unavailable(None)  # installed: nothing happens
    monkeypatch.delenv("PARAVT_REQUIRE_ENGINES", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make sglang-cpu"):
        engine_unavailable("SGLang's CPU engine is not installed (.venv-sglang missing: `make sglang-cpu`)")
    monkeypatch.setenv("PARAVT_REQUIRE_ENGINES", "1")
    with pytest.raises(pytest.fail.Exception, match="PARAVT_REQUIRE_ENGINES"):
        engine_unavailable("SGLang's CPU engine is not installed (.venv-sglang missing: `make sglang-cpu`)")


def test_the_engine_install_is_pinned_and_refuses_what_would_break_it(tmp_path):
    """tests/sglang_cpu/install.sh: the engine's requirements the wheel leaves unpinned are installed under a
    constraints file of a known-good set (a new release of one cannot change the engine under the tests), and it
    refuses TARGET == BASE (TARGET is deleted first: it would have deleted the project's venv) and a Python
    below 3.11, before touching anything."""
    script = ROOT / "tests" / "sglang_cpu" / "install.sh"
    pins = [ln for ln in (script.parent / "constraints.txt").read_text().splitlines() if ln and ln[0] != "#"]
    assert pins and all(ln.count("==") == 1 and " " not in ln for ln in pins)
    names = {ln.split("==")[0] for ln in pins}
    assert {"fastapi", "uvicorn", "numpy", "pydantic", "transformers", "openai", "xgrammar"} <= names
    assert '-c "$CONSTRAINTS"' in script.read_text()
    venv_sglang = ROOT / ".venv-sglang"
    if (venv_sglang / ".installed").is_file():  # the set the suite runs against is the one pinned
        import importlib.metadata as md

        site = next((venv_sglang / "lib").glob("python3*/site-packages"))
        own = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions(path=[str(site)])}
        pinned = dict(ln.split("==") for ln in pins)
        assert {n: v for n, v in own.items() if n in pinned} == {n: pinned[n] for n in own if n in pinned}
        assert set(own) - set(pinned) <= {"pip", "setuptools", "sglang", "sglang-router"}

    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "python").write_text("#!/bin/sh\necho 3.10\n")
    (fake / "bin" / "python").chmod(0o755)
    (fake / "keep").write_text("the base venv")
    same = subprocess.run(["bash", str(script)], env={**os.environ, "BASE": str(fake), "TARGET": str(fake)},
                          capture_output=True, text=True, cwd=tmp_path)
    assert same.returncode == 2 and "TARGET" in same.stderr and "is BASE" in same.stderr and (fake / "keep").exists()
    old = subprocess.run(["bash", str(script)], env={**os.environ, "BASE": str(fake),
                                                     "TARGET": str(tmp_path / "target")},
                         capture_output=True, text=True, cwd=tmp_path)
    assert old.returncode == 2 and "Python 3.10" in old.stderr and ">= 3.11" in old.stderr
    assert not (tmp_path / "target").exists()


# ------------------------------------------------------------------------------------------- SGLang itself


def test_sglang_itself_reports_what_the_syncs_read(sglang_toy):
    """SGLang 0.5.23 (CPU engine, started by the launcher `paravt serve` uses) answers /server_info with what the
    syncs and the policy read: its TP and DP sizes, deterministic inference, and its vision-feature cache size
    (SGLANG_EXPOSE_OWN_ENV_VARS, set by the launcher; the suite's servers run with the cache off)."""
    from paravt_agent.policy.sglang_backend import SGLangPolicy

    with httpx.Client() as c:
        facts = server_facts(c, sglang_toy.url)
    assert (facts.tp_size, facts.dp_size, facts.deterministic, facts.vlm_cache_mb) == (1, 1, False, 0)
    assert SGLangPolicy(sglang_toy.model, sglang_toy.url).server_deterministic() is False


def test_paravt_serves_supervisor_asks_each_route_with_the_key_it_takes(tiny_model, stand_in):
    """A server started with --api-key and --admin-api-key (SGLang 0.5.23's rules: /ping takes the API key only,
    the admin routes the admin key only, /ready none): 0.5.1's supervisor pinged with the admin key, got 401, read
    "cannot say" and never continued a dead pusher's pause. Now it pings with the API key and continues with the
    admin key; `paravt serve` passes it both."""
    from paravt_agent.serving.supervisor import PauseSupervisor, supervise

    srv = stand_in(tiny_model, "--api-key", "user-key", "--admin-api-key", "admin-key")
    admin = {"Authorization": "Bearer admin-key"}
    paused = httpx.post(srv.url + "/pause_generation", json={"mode": "abort"}, headers=admin, timeout=30)
    assert paused.status_code == 200
    assert httpx.get(srv.url + "/ping", headers=admin, timeout=30).status_code == 401  # the admin key alone
    old = PauseSupervisor([srv.url], lease=1, max_pause=1, admin_key="admin-key", log=lambda *_: None)  # 0.5.1's
    t0 = time.time()
    assert old.check(now=t0) == [] and old.check(now=t0 + 5) == [] and not old.paused_since
    sup = supervise("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), 1, 60, None, max_pause=1, log=lambda *_: None,
                    api_key="user-key", admin_key="admin-key")
    try:
        deadline = time.time() + 30
        while not sup.continued:
            assert time.time() < deadline, "the supervisor never continued the pause"
            time.sleep(0.2)
    finally:
        sup.stop()
    assert httpx.get(srv.url + "/ready", timeout=30).status_code == 200  # generation runs again
    assert sup.continued[0]["why"] == "max-pause"


# ---------------------------------------------------------------------------------------------- rejoin ports


def test_rejoin_ports_are_never_an_http_port_or_inside_sglangs_ranges(monkeypatch):
    """A failed distributed push rejoins on another port (a group NCCL could not abort keeps its store's port).
    0.5.1 moved from 29600 by 100 a failure: after 4 failures 30000, SGLang's default HTTP port, and the whole walk
    inside SGLang's NCCL range (22000-29999). Now: the default is 31000, a configured port inside SGLang's ranges is
    refused, and no rejoin port of any server after any number of failures is a server's HTTP port, inside SGLang's
    ranges or the OS's ephemeral range (read from this machine); the trainer's group outlives the push deadline."""
    import pydantic

    from paravt_train.sync import distributed
    from paravt_train.sync.config import SyncSettings

    assert SyncSettings().master_port == 31000
    for old in (29600, 30000, 22000):
        with pytest.raises(pydantic.ValidationError, match="inside SGLang's own ports"):
            SyncSettings(master_port=old)
    lo, hi = distributed.ephemeral_ports()
    servers = [f"http://10.1.0.{i}:{p}" for i, p in enumerate((31001, 31100, 31302, 30000))]
    sync = SGLangDistributedSync(servers, master_port=31000, backend="gloo")
    seen = set()
    for k, url in enumerate(sync.urls):
        for failures in range(40):
            sync.rejoins[url] = failures
            port = sync.port_of(url, k)
            seen.add(port)
            assert port not in (31001, 31100, 31302, 30000) and not lo <= port <= hi
            assert not any(a <= port <= b for a, b, _ in distributed.SGLANG_PORTS), port
    assert len(seen) >= 7 * len(servers) - 3  # each server's cycle of 7 ports, apart from the others'
    # a machine whose ephemeral range starts low: the walk moves past it, or says there is no room left
    monkeypatch.setattr(distributed, "ephemeral_ports", lambda: (31050, 48000))
    sync.rejoins.clear()
    assert [sync.port_of(u, k) for k, u in enumerate(sync.urls[:2])] == [31000, 31002]  # 31001: a server's
    sync.rejoins[sync.urls[0]] = 1
    assert sync.port_of(sync.urls[0], 0) == 48001  # 31100 .. 48000 are taken
    monkeypatch.setattr(distributed, "ephemeral_ports", lambda: (31050, 65535))
    with pytest.raises(PolicyError, match="no rendezvous port.*1024-21999 or 30001-32767"):
        sync.port_of(sync.urls[0], 0)


def test_a_group_name_left_in_this_process_by_a_sync_never_closed_is_taken_over():
    """A syncer that is never closed (a notebook's earlier trainer, a test that forgot) leaves its side of the group
    in the process under the group's name, and torch refuses a name twice: the next trainer's join failed with
    "The specified group name has already been created" (0.5.2 before this fix, when a multi-host test left one).
    The join now destroys the stale group first; the new group works."""
    import torch.distributed as dist

    from paravt_train.sync.distributed import init_weight_update_group

    name = "paravt_test_left_over"
    first = init_weight_update_group("127.0.0.1", rendezvous_port(), 0, 1, name, backend="gloo", timeout_s=30)
    second = init_weight_update_group("127.0.0.1", rendezvous_port(), 0, 1, name, backend="gloo", timeout_s=30)
    t = torch.ones(3)
    dist.broadcast(t, src=0, group=second)
    assert [n for n in dist.distributed_c10d._world.pg_names.values() if n == name] == [name]
    assert first not in dist.distributed_c10d._world.pg_names
    dist.destroy_process_group(second)
