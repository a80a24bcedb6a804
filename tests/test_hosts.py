"""The layouts docs/training.md advertises across machines, run across hosts: network namespaces on this machine
(``tests/hosts.py``: each host its own address, loopback and view of the disk), with SGLang's CPU engine and
sglang-router on one host, the trainer on another, the online learner on a third, and the faults that happen
between them (a trainer host killed mid-bucket, a network partition mid-push, a pause ended mid-push).

One fleet serves the module: ``paravt serve --dp 2 --lora-rank 4`` on host ``serve`` (two SGLang workers behind
sglang-router, registered under the host's address; LoRA on, so every sync can reach it) with a short pause cap
(``--max-pause``) and weight-group timeout, so the faults' bounds are seconds. Host ``train`` has no shared disk:
what reaches the fleet from there goes over the network. The trainer on two hosts (torchrun's multi-node
rendezvous) is in tests/test_sft.py and tests/test_rl.py (``host_bed``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import engine_unavailable

#: the fleet's supervisor: a pause ends this long after it began, whoever holds it (``--max-pause``)
MAX_PAUSE = 8.0
#: the workers' weight-update group gives up a receive its trainer never sends after this long
#: (``--weight-group-timeout``; SGLang's own: torch's 30 minutes)
GROUP_TIMEOUT = 6.0
#: how much later than its bound a worker may answer on this machine (the supervisor's 1 s poll, a request's own
#: time on a shared 2-core CPU)
SLACK = 12.0
ROOT = Path(__file__).resolve().parents[1]
IDS = [int(x) for x in torch.randint(10, 300, (24,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    from tests.hosts import HostBed, unavailable
    from tests.sglang_cpu.server import unavailable as no_engine

    engine_unavailable(unavailable())
    engine_unavailable(no_engine())
    with HostBed(["serve", "train", "learn"], root=tmp_path_factory.mktemp("hosts"),
                 no_shared_disk={"train"}) as made:
        yield made


class Fleet:
    def __init__(self, bed, log: Path, proc):
        self.bed, self.log, self.proc = bed, log, proc
        self.router = bed["serve"].url(30000)
        self.workers = [bed["serve"].url(30001), bed["serve"].url(30002)]

    def version(self, url: str) -> str:
        return httpx.get(url + "/model_info", timeout=30).json()["weight_version"]

    def logprobs(self, url: str, lora: str | None = None) -> list[float]:
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0, **({"lora_path": lora} if lora else {})}
        out = httpx.post(url + "/generate", json=body, timeout=120).json()
        return [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]

    def said(self) -> str:
        return self.log.read_text(errors="replace")


def env_of(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", **extra}


@pytest.fixture(scope="module")
def fleet(bed, toy_policy_dir):
    from tests.sglang_cpu.server import PYTHON

    serve = bed["serve"]
    log = bed.root / "serve.log"
    t0 = time.monotonic()
    proc = serve.popen([str(Path(sys.executable).with_name("paravt")), "serve", toy_policy_dir, "--device", "cpu",
                        "--python", str(PYTHON), "--host", serve.addr, "--port", "30000", "--dp", "2",
                        "--lora-rank", "4", "--max-total-tokens", "4096", "--vlm-cache-mb", "0",
                        "--max-pause", str(MAX_PAUSE), "--weight-group-timeout", str(GROUP_TIMEOUT)],
                       env=env_of(), log=log)
    while "healthy: " not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() - t0 < 400, log.read_text(errors="replace")[-4000:]
        time.sleep(0.5)
    made = Fleet(bed, log, proc)
    made.start_seconds = time.monotonic() - t0
    yield made


def _model_logprobs(model) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([IDS])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(IDS[1:])[:, None])[:, 0].tolist()


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_fleet_on_one_host_takes_every_sync_from_a_trainer_on_another(fleet, toy_policy_dir, monkeypatch):
    """docs/training.md's "server on another node" row, for each sync, against ``paravt serve --dp 2``: the router
    lists its workers under the serve host's address (0.5.1 registered them as 127.0.0.1, so a trainer elsewhere
    paused and updated its own localhost); a trainer on this host pushes by ``disk`` (a model directory on the
    shared disk), ``distributed`` (gloo over the network, a group per worker, no disk) and ``lora`` (an adapter on
    the shared disk), and every worker then scores as the trainer's model does. The min_p guard asks the workers
    across the network (the router itself answers /server_info with 404)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from paravt_agent.policy.endpoints import deterministic_inference, router_workers
    from paravt_train.sync.disk import SGLangWeightSync
    from paravt_train.sync.distributed import SGLangDistributedSync
    from paravt_train.sync.lora import SGLangLoraSync
    from tests.conftest import rendezvous_port

    bed = fleet.bed
    with httpx.Client() as client:
        assert sorted(router_workers(client, fleet.router)) == fleet.workers  # at 10.213.K.1, not 127.0.0.1
        assert deterministic_inference(client, fleet.router) is False  # asked of each worker over the network
    model = AutoModelForImageTextToText.from_pretrained(toy_policy_dir).eval()

    # disk: rank 0 writes a model directory on the shared disk; each worker loads it
    with torch.no_grad():
        next(iter(model.parameters())).add_(0.3)
    shipped = bed.shared / "step-1"
    model.save_pretrained(shipped)
    for f in Path(toy_policy_dir).iterdir():
        if f.is_file() and not (shipped / f.name).exists():
            shutil.copy(f, shipped / f.name)
    assert SGLangWeightSync(fleet.router, bed.shared / "weights").serve(shipped, version="1")["success"]
    want = _model_logprobs(model)
    assert [fleet.version(w) for w in fleet.workers] == ["1", "1"]
    assert all(_close(fleet.logprobs(w), want) < 1e-4 for w in fleet.workers)

    # distributed: a group per worker, rendezvous at this host's address, gloo on its interface; no disk at all
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", bed.here.iface)
    with torch.no_grad():
        next(iter(model.parameters())).add_(-0.2)
    sync = SGLangDistributedSync(fleet.router, master_address=bed.here.addr, master_port=rendezvous_port(),
                                 backend="gloo", device="cpu", bucket_bytes=1 << 20, timeout=120)
    try:
        out = sync.push(model, version="2")
    finally:
        sync.close()  # leaves the groups on both sides: later tests in this process join under the same names
    assert out["servers"] == 2 and out["buckets"] > 1
    want = _model_logprobs(model)
    assert [fleet.version(w) for w in fleet.workers] == ["2", "2"]
    assert all(_close(fleet.logprobs(w), want) < 1e-4 for w in fleet.workers)

    # lora: an adapter directory on the shared disk, swapped in by name on each worker (over version 2's weights)
    import copy

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    (bed.shared / "adapters").mkdir()
    peft_model.save_pretrained(bed.shared / "adapters" / "v1")
    assert SGLangLoraSync(fleet.router, bed.shared / "adapters", name="paravt").serve(
        bed.shared / "adapters" / "v1", version="3")["success"]
    want = _model_logprobs(peft_model.eval())
    assert all(_close(fleet.logprobs(w, lora="paravt"), want) < 1e-4 for w in fleet.workers)
    assert [fleet.version(w) for w in fleet.workers] == ["3", "3"]


def _trainer(fleet, version: str, *args: str):
    """``tests/hosts_trainer.py`` on host ``train`` (no shared disk), pushing to the fleet over the network."""
    from tests.conftest import rendezvous_port

    train = fleet.bed["train"]
    log = fleet.bed.root / f"trainer-{version}.log"
    proc = train.popen([sys.executable, str(ROOT / "tests" / "hosts_trainer.py"), fleet.router, train.addr,
                        str(rendezvous_port()), version, *args],
                       env=env_of(PARAVT_HOSTS_MODEL=os.environ.get("PARAVT_HOSTS_MODEL", "")), log=log)
    return proc, log


def _wait_for(log: Path, word: str, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while word not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def _paused_worker(fleet) -> str:
    deadline = time.monotonic() + 30
    while True:
        for w in fleet.workers:
            if httpx.get(w + "/ready", timeout=10).status_code == 503:
                return w
        assert time.monotonic() < deadline, "no worker is paused"
        time.sleep(0.2)


def _answered_after(url: str, t0: float) -> float:
    out = httpx.post(url + "/generate", timeout=300, json={"input_ids": IDS[:4],
                                                           "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 2
    return time.monotonic() - t0


def test_a_trainer_host_lost_mid_bucket_leaves_users_answered_within_the_bound(fleet, toy_policy_dir, monkeypatch):
    """A distributed push whose trainer host goes away after a worker posted its receives for a bucket: SGLang
    waits on them in its scheduler (generation, /continue_generation, /server_info all wait behind it), with
    torch's default timeout of 30 minutes on its group. ``paravt serve`` now gives its servers' groups
    ``--weight-group-timeout`` and supervises their pauses (``--max-pause``, or the lease of a push journal on a
    shared disk), so the worker answers users again within max(--max-pause, --weight-group-timeout) plus a poll:

    * ``kill -9`` of the trainer mid-bucket: gloo sees the connection close at once, the update fails, and the
      pause ends at the cap (measured here: ~8-9 s with an 8 s cap; 0.5.1: never, 600 s waited);
    * a network partition (the trainer host's switch port down: no connection is told): the receive waits out the
      group timeout, then the same.

    Through the router users are answered all along by the other worker; afterwards a trainer that starts again
    pushes to both workers (a new group each: the server's old one is destroyed first)."""
    monkeypatch.setenv("PARAVT_HOSTS_MODEL", toy_policy_dir)
    bound = max(MAX_PAUSE, GROUP_TIMEOUT)
    measured = {}
    for fault in ("kill", "partition"):
        proc, log = _trainer(fleet, f"lost-{fault}", "--shift", "0.1", "--stall-at", "5")
        _wait_for(log, "STALLED", proc)
        wedged = _paused_worker(fleet)
        time.sleep(1.0)  # the worker is inside the bucket's receive
        t0 = time.monotonic()
        if fault == "kill":
            os.killpg(proc.pid, 9)
        else:
            fleet.bed["train"].cut()
        try:
            assert _answered_after(fleet.router, t0) < 5 + SLACK  # the other worker serves meanwhile
            measured[fault] = _answered_after(wedged, t0)
        finally:
            if fault != "kill":
                fleet.bed["train"].heal()
                os.killpg(proc.pid, 9)
        assert measured[fault] < bound + SLACK, (fault, measured, fleet.said()[-3000:])
    said = fleet.said()
    assert said.count("Failed to receive weights") >= 2, said[-3000:]
    assert "Connection closed by peer" in said and re.search(r"Timed out|timeout", said.split("Connection closed")[-1])
    assert len(re.findall(r"pause supervisor: .* \(past --max-pause", said)) >= 2
    proc, log = _trainer(fleet, "after-faults", "--shift", "0.2")
    proc.wait(240)
    result = json.loads(log.read_text().strip().splitlines()[-1])
    assert result.get("result", {}).get("servers") == 2, log.read_text()[-3000:]
    assert [fleet.version(w) for w in fleet.workers] == ["after-faults", "after-faults"]
    print(f"users answered again after: kill -9 {measured['kill']:.1f}s, partition {measured['partition']:.1f}s "
          f"(--max-pause {MAX_PAUSE:g}s, --weight-group-timeout {GROUP_TIMEOUT:g}s)")


def test_a_pause_ended_mid_push_across_hosts_is_applied_flushed_then_named(fleet, toy_policy_dir, monkeypatch):
    """A distributed push slower than the fleet's ``--max-pause``: the supervisor continues the worker between two
    buckets. The push is reported applied (not failed), the mix is logged with both versions, and on that worker
    the radix cache is flushed before the served version changes (the access log's order)."""
    monkeypatch.setenv("PARAVT_HOSTS_MODEL", toy_policy_dir)
    before = {w: fleet.version(w) for w in fleet.workers}
    start = len(fleet.said())
    proc, log = _trainer(fleet, "slow", "--shift", "0.05", "--sleep-at-half", str(MAX_PAUSE + 4))
    proc.wait(300)
    lines = log.read_text().strip().splitlines()
    result = json.loads(lines[-1])["result"]
    applied = {"success": True, "applied": True, "flushed": True, "weight_version": "slow"}
    # the stream is read once per worker, and slept in each: both pauses were ended by the supervisor
    assert result["unflushed"] == {w: applied for w in fleet.workers}, lines[-5:]
    for w in fleet.workers:
        assert any(f"generation on {w} was continued" in x and f"mix of version {before[w]} and slow" in x
                   for x in lines), lines
    assert [fleet.version(w) for w in fleet.workers] == ["slow", "slow"]
    after = fleet.said()[start:]
    for w in fleet.workers:
        assert re.search(rf"{re.escape(w)} was paused .*past --max-pause", after), after[-3000:]
    # the workers' access log (one worker after the other): on each the flush (once idle), then the version named
    order = [x.split('"')[1].split()[1].split("?")[0] for x in after.splitlines()
             if '"POST /flush_cache' in x or '"POST /update_weight_version' in x]
    assert order == ["/flush_cache", "/update_weight_version"] * 2, order


def test_an_online_learner_on_a_third_host_promotes_to_the_fleet(fleet, toy_policy_dir, toy_rl, tmp_path):
    """The online learner on host ``learn`` (its store and output on the shared disk), the fleet on ``serve``,
    the users' client here: it rolls out through the router, trains on the feedback, and each version it promotes
    reaches both workers (disk sync), with its push journal beside its output."""
    import yaml

    from paravt_agent.store import TrajectoryStore
    from paravt_agent.trajectory import Trace

    bed = fleet.bed
    store = TrajectoryStore(bed.shared / "traces.db")
    for i, w in enumerate(toy_rl["worlds"][:2]):
        q = next(q for q in w.questions if q.options)
        t = Trace(video=w.video, question=q.question, options=q.options)
        store.add(t)
        store.feedback(t.id, answer=q.answer, user=f"user-{i}")
    out = bed.shared / "learner"
    cfg = {"model": toy_policy_dir, "video_root": toy_rl["video_root"], "output_dir": str(out),
           "backend": "sglang", "endpoint": fleet.router, "prompts_per_step": 2, "group_size": 2,
           "max_new_tokens": 64, "subagent_max_new_tokens": 32, "temperature": 1.2, "lr": 1e-3, "save_every": 100,
           "concurrency": 2, "gating_choices": [4], "sync": {"via": "disk"}}
    path = bed.shared / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = bed["learn"].popen([sys.executable, str(ROOT / "tests" / "scale_worker.py"), "online", str(path),
                               "--store", str(store.path)], env=env_of(), log=bed.root / "learner.log")
    assert proc.wait(400) == 0, (bed.root / "learner.log").read_text()[-4000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs and recs[-1]["episodes"] > 0
    served = {fleet.version(w) for w in fleet.workers}
    assert served == {str(recs[-1]["step"])}, served


def test_paravt_serve_runs_sglangs_cpu_engine_and_a_sigterm_stops_its_whole_fleet(fleet):
    """(Last: it stops the module's fleet.) `paravt serve MODEL --device cpu --dp 2` started SGLang's CPU engine
    (the torch-native attention, float32, SGLang 0.5.23) behind sglang-router, each worker under the host's address;
    a SIGTERM to the command stops every process it started (workers, their schedulers and detokenizers, the
    router): nothing listens on the fleet's ports and no process is left on its host."""
    import signal
    import subprocess

    said = fleet.said()
    assert said.count("--device cpu --attention-backend torch_native") == 2  # the printed worker commands
    assert f"--worker-urls {' '.join(fleet.workers)}" in said
    for w in fleet.workers:
        info = httpx.get(w + "/server_info", timeout=60).json()
        assert (info["version"], info["dtype"], info["attention_backend"]) == ("0.5.23", "float32", "torch_native")
    fleet.proc.send_signal(signal.SIGTERM)
    fleet.proc.wait(90)
    serve = fleet.bed["serve"]
    deadline = time.monotonic() + 30
    while True:
        listening = [u for u in (fleet.router, *fleet.workers) if _answers(u)]
        left = subprocess.run(["ip", "netns", "pids", serve.namespace], capture_output=True, text=True).stdout.split()
        if not listening and not left:
            break
        assert time.monotonic() < deadline, f"still listening: {listening}; processes left: {left}"
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return False
    return True
