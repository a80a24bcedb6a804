"""Operating online learning against live servers (issue #56): a LoRA push records the weight version its rollouts
report (so a LoRA run with η > 0 trains), and a learner killed during a push never leaves the server paused for
more than a bounded time (the lease and ``paravt serve``'s pause supervisor), its next start repairing the push.
Recording JSON servers for the wire, SGLang 0.5.23 itself on CPU for the behaviour."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from paravt_agent.errors import ConfigError, PolicyError
from paravt_agent.serving.supervisor import PauseSupervisor, supervise, supervised_urls
from paravt_train.sync.disk import SGLangWeightSync
from paravt_train.sync.lease import journal_push, unfinished_push
from paravt_train.sync.lora import SGLangLoraSync

ROOT = Path(__file__).resolve().parents[1]


def _adapter(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"x" * 10)
    return d


# --------------------------------------------------------------------------- LoRA versions


def test_a_lora_push_records_its_version_after_the_swap_and_refuses_a_server_that_cannot(tmp_path, json_server):
    """SGLang's adapter loads name no weight version: after the swap the sync records it with
    ``/update_weight_version`` (aborting nothing), on every server; a server without the route is a ConfigError
    that says why (its rollouts would all report version 0), not a push that silently leaves version 0."""
    ok = json_server(lambda path, body: (200, {"success": True}))
    SGLangLoraSync(ok.url, name="paravt").serve(_adapter(tmp_path / "adapter-3"), "3")
    assert ok.paths == ["/workers", "/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version"]
    assert ok.bodies[-1] == {"new_version": "3", "abort_all_requests": False}
    # no version (a candidate loaded for a look): nothing recorded
    SGLangLoraSync(ok.url, name="paravt").serve(_adapter(tmp_path / "adapter-x"))
    assert ok.paths[-1] == "/load_lora_adapter"

    old = json_server(lambda path, body: (404, {"detail": "Not Found"}) if path == "/update_weight_version"
                      else (200, {"success": True}))
    with pytest.raises(ConfigError, match=r"no /update_weight_version.*version 0"):
        SGLangLoraSync(old.url, name="paravt").serve(_adapter(tmp_path / "adapter-4"), "4")
    bad = json_server(lambda path, body: (400, {"success": False, "message": "nope"})
                      if path == "/update_weight_version" else (200, {"success": True}))
    with pytest.raises(PolicyError, match="refused 5: nope"):
        SGLangLoraSync(bad.url, name="paravt").serve(_adapter(tmp_path / "adapter-5"), "5")


@pytest.mark.slow
def test_lora_pushes_change_the_version_rollouts_report_and_a_run_with_eta_trains(toy_policy_dir, toy_rl, tmp_path,
                                                                                  own_sglang):
    """SGLang 0.5.23 on CPU serving LoRA: an offline LoRA run with η = 1 (the asynchronous loop) pushes its adapter
    after every update; each push records the version, so the rollouts report it: no group is dropped as too
    stale and every update trains (before, every reply said version 0 and every update after the first η was
    dropped whole). A request naming the adapter reports the last push's version."""
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer

    [srv] = own_sglang(toy_policy_dir, lora_rank=4)
    cfg = GRPOConfig(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"],
                     output_dir=str(tmp_path / "run"), steps=3, prompts_per_step=1, group_size=2, max_new_tokens=32,
                     subagent_max_new_tokens=16, temperature=0.7, lr=1e-3, save_every=100, concurrency=2,
                     gating_choices=[4], kl_coef=0.0, lora={"enabled": True, "r": 4, "alpha": 8},
                     backend="sglang", endpoint=srv.url, sync={"via": "lora"}, max_staleness=1)
    GRPOTrainer(cfg, progress=False, log=lambda *_: None).run()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["dropped_stale"] for r in recs] == [0, 0, 0], [(r["step"], r.get("staleness")) for r in recs]
    assert all(r["episodes"] > 0 for r in recs)
    out = httpx.post(srv.url + "/generate", timeout=120, json={
        "input_ids": [20, 21, 22], "lora_path": cfg.sync.lora_name,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}).json()
    assert out["meta_info"]["weight_version"] == "3"
    print(f"server start {srv.start_seconds:.0f}s; per step rollout/update/sync s: "
          + ", ".join(f"{r['rollout_seconds']:.1f}/{r['update_seconds']:.1f}/{r['sync_seconds']:.1f}" for r in recs))


# --------------------------------------------------------------------------- the lease and the journal


def test_a_push_journals_itself_renews_its_lease_while_it_runs_and_clears_it(tmp_path, json_server):
    """With a journal (the online learner's ``push.json``) every push writes it before it pauses, renews its time
    every second while the server loads, and removes it when the push ends, finished or failed (a failed push has
    continued generation already); without one nothing is written."""
    journal = tmp_path / "out" / "push.json"
    seen: dict = {}

    def reply(path, body):
        if path == "/pause_generation":
            seen["at_pause"] = unfinished_push(journal)
        if path == "/update_weights_from_disk" and body["weight_version"] == "8":
            time.sleep(2.6)  # a slow load: the lease must be renewed meanwhile
            seen["renewed"] = journal.stat().st_mtime
        if path == "/update_weights_from_disk" and body["weight_version"] == "9":
            return 400, {"success": False, "message": "broken"}
        return 200, {"success": True}

    srv = json_server(reply)
    SGLangWeightSync(srv.url, journal=journal).serve(tmp_path, "8")
    rec = seen["at_pause"]
    assert (rec["version"], rec["sync"], rec["urls"], rec["pid"]) == ("8", "disk", [srv.url], os.getpid())
    assert seen["renewed"] - rec["renewed"] >= 1.5  # renewed while the server loaded
    assert not journal.exists()
    with pytest.raises(PolicyError, match="broken"):
        SGLangWeightSync(srv.url, journal=journal).serve(tmp_path, "9")
    assert not journal.exists() and srv.paths[-1] == "/continue_generation"
    with journal_push(journal, [srv.url], "1", "disk"):  # the journal is the sync's: what it was made with
        assert unfinished_push(journal)["version"] == "1"
    assert not journal.exists()
    SGLangWeightSync(srv.url).serve(tmp_path, "10")  # a sync made without one (a shadow server's) writes none
    assert not journal.exists()


def test_the_supervisor_continues_a_pause_only_once_its_lease_has_lapsed(tmp_path, json_server):
    """``paravt serve``'s supervisor reads each server's state (SGLang: ``/ready`` 503 and ``/ping`` 200 while
    paused): a pause whose lease is renewed stays, however long; one whose lease lapsed (the pusher died) is
    continued ``lease`` seconds (of the supervisor's clock) after it last saw the lease renewed; without a lease
    file, ``max_pause`` seconds after the pause began. A server that is not paused, or cannot say, is left
    alone."""
    state = {"paused": True}

    def reply(path, body):
        if path == "/ready":
            return (503 if state["paused"] else 200), {}
        if path == "/ping":
            return 200, {}
        if path == "/continue_generation":
            state["paused"] = False
        return 200, {}

    srv = json_server(reply)
    lease = tmp_path / "push.json"
    lease.write_text("{}")  # a journal without a counter (0.5.1's): its renewals are changes of its file time
    sup = PauseSupervisor([srv.url], lease=10, lease_file=lease, log=lambda *_: None)
    t0 = 1000.0  # the supervisor's own (monotonic) clock: the times on the file are never compared with it
    with httpx.Client() as c:
        assert sup.check(c, now=t0) == [] and sup.paused_since[srv.url] == t0
        os.utime(lease, (1, 1))  # a live pusher renews (whatever its clock, or the disk's, stamps)
        assert sup.check(c, now=t0 + 9) == []
        assert sup.check(c, now=t0 + 18) == []  # 18 s of pause, the renewal seen 9 s ago
        assert sup.check(c, now=t0 + 19.5) == [srv.url]  # 10.5 s without a renewal
        assert not state["paused"] and sup.continued[0]["lease_age_s"] == 10.5
        assert sup.check(c, now=t0 + 60) == []  # running: nothing to do
        state["paused"] = True
        # a hung pusher renews for ever: capped at max_pause from the start
        capped = PauseSupervisor([srv.url], lease=10, lease_file=lease, max_pause=20, log=lambda *_: None)
        assert capped.check(c, now=t0 + 90) == []
        os.utime(lease, (2, 2))
        assert capped.check(c, now=t0 + 105) == []
        os.utime(lease, (3, 3))
        assert capped.check(c, now=t0 + 111) == [srv.url] and capped.continued[0]["why"] == "max-pause"
        state["paused"] = True
        lease.unlink()  # no lease file: bounded by max_pause from the pause's start, not by the lease
        bare = PauseSupervisor([srv.url], lease=5, max_pause=8, log=lambda *_: None)
        assert bare.check(c, now=t0) == [] and bare.check(c, now=t0 + 6) == []
        assert bare.check(c, now=t0 + 9) == [srv.url] and not state["paused"]
    down = PauseSupervisor(["http://127.0.0.1:9"], lease=1, log=lambda *_: None)
    assert down.check(now=t0) == [] and down.check(now=t0 + 100) == []
    with pytest.raises(ValueError):
        PauseSupervisor([srv.url], lease=0)
    # what `paravt serve` supervises: its one server, or the router's workers (the router forwards no pause)
    assert supervised_urls("0.0.0.0", 30000) == ["http://127.0.0.1:30000"]
    # (the workers at the address they are registered under: the serve host, or --worker-host)
    assert supervised_urls("10.0.0.5", 30000, dp=2) == ["http://10.0.0.5:30001", "http://10.0.0.5:30002"]
    assert supervised_urls("0.0.0.0", 30000, dp=2, worker_host="10.0.0.6") == ["http://10.0.0.6:30001",
                                                                                "http://10.0.0.6:30002"]
    assert supervise("127.0.0.1", 30000, 1, 0, log=lambda *_: None) is None  # --pause-lease 0: off
    assert supervise("127.0.0.1", 30000, 1, 60, None, max_pause=0, log=lambda *_: None) is None  # nothing bounds


# --------------------------------------------------------------------------- kill -9 during a push, SGLang itself

#: the prelude of a process that hangs once a server is paused (what one killed there leaves): every httpx POST goes
#: through, and after ``/pause_generation`` it says PAUSED and sleeps
PAUSE_THEN_HANG = textwrap.dedent("""
    import sys, time
    import httpx

    real = httpx.Client.post

    def post(self, url, *a, **kw):
        resp = real(self, url, *a, **kw)
        if str(url).endswith("/pause_generation"):
            print("PAUSED", flush=True)
            time.sleep(3600)
        return resp

    httpx.Client.post = post
""")

#: a pusher that hangs once the server is paused (what a learner killed there leaves): the real sync, its journal
HANG = PAUSE_THEN_HANG + textwrap.dedent("""
    from paravt_train.sync.disk import SGLangWeightSync

    SGLangWeightSync(sys.argv[1], journal=sys.argv[3]).serve(sys.argv[2], "7")
""")


def _hang(url: str, model: str, journal: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HANG, url, model, str(journal)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line.strip() == "PAUSED", proc.stderr.read()[-2000:] if proc.poll() is not None else line
    return proc


def _ready(url: str) -> int:
    return httpx.get(url + "/ready", timeout=10).status_code


@pytest.mark.slow
def test_a_pause_the_supervisor_ends_mid_push_is_reported_applied_flushed_then_named(tmp_path, toy_policy_dir,
                                                                                      sglang_stub):
    """A streamed push slower than ``paravt serve --max-pause``: the supervisor continues generation between two
    buckets, and requests then run on a mix of the served version and the new one. Before, the last bucket still
    asked for a flush (refused while requests ran: the push was reported failed although the weights and the
    version were applied) and named the new version over cached old-weight prefixes. Now the sync sees the pause
    ended (``/ready``), says so with both versions, sends the last bucket without flush or version, and then
    flushes once the server is idle and only then names the version: reported applied, flushed, named."""
    import torch
    from transformers import AutoModelForImageTextToText

    from paravt_train.sync.streamed import SGLangTensorSync, stream_parameters

    srv = sglang_stub(toy_policy_dir)
    sup = PauseSupervisor([srv.url], lease=60, max_pause=1.5, poll=0.25, log=lambda *_: None).start()
    said: list[str] = []
    named = list(stream_parameters(AutoModelForImageTextToText.from_pretrained(toy_policy_dir)))

    def slow():  # the supervisor's cap passes half-way through the stream
        for i, item in enumerate(named):
            if i == len(named) // 2:
                time.sleep(4.0)
            yield item

    reply: dict = {}

    def user():  # a request that runs from the continue to past the last bucket
        while not sup.continued:
            time.sleep(0.05)
        reply.update(httpx.post(srv.url + "/generate", timeout=120, json={
            "input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}).json())

    t = threading.Thread(target=user)
    t.start()
    try:
        out = SGLangTensorSync(srv.url, bucket_bytes=1 << 20, log=said.append).send_tensors(slow, version="7")
    finally:
        sup.stop()
        t.join(120)
    assert sup.continued and sup.continued[0]["why"] == "max-pause"
    assert out["success"] and out["unflushed"] == {srv.url: {"success": True, "applied": True, "flushed": True,
                                                             "weight_version": "7"}}
    assert any("continued during the push of version 7" in m and "mix of version default and 7" in m for m in said)
    assert httpx.get(srv.url + "/model_info", timeout=30).json()["weight_version"] == "7"
    assert reply["meta_info"]["finish_reason"]["type"] == "length"  # the user's request was answered
    assert srv.proc.poll() is None and torch.is_tensor(named[0][1])


def test_a_pusher_killed_during_a_push_leaves_sglang_answering_within_the_lease_and_the_restart_repairs(
        sglang_toy, toy_policy_dir, tmp_path):
    """SGLang 0.5.23 on CPU. A push is paused on the server and its process renews the lease: the supervisor leaves
    that pause alone past the lease. ``kill -9`` of the pusher: a user's request waiting on the paused server is
    answered within the lease (+ a poll) of the kill. Then, with no supervisor, another killed push leaves the
    server paused until the next learner start, which finds the journal, continues generation, puts the version
    its registry serves back (version 0, the starting weights) and records the repair."""
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    url, lease = sglang_toy.url, 6.0
    out = tmp_path / "learner"
    journal = out / "push.json"
    sup = PauseSupervisor([url], lease=lease, lease_file=journal, poll=0.5, log=lambda *_: None).start()
    try:
        proc = _hang(url, toy_policy_dir, journal)
        assert _ready(url) == 503 and unfinished_push(journal)["version"] == "7"
        time.sleep(lease + 2)  # a live pusher's pause outlasts the lease: it renews it
        assert _ready(url) == 503 and sup.continued == [] and proc.poll() is None
        answer: dict = {}

        def user():
            answer["reply"] = httpx.post(url + "/generate", timeout=120, json={
                "input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}})
            answer["at"] = time.monotonic()

        t = threading.Thread(target=user)
        t.start()
        time.sleep(1.0)
        assert t.is_alive()  # paused: the user waits
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        t.join(lease + 20)
        assert "at" in answer, "the server stayed paused after the pusher died"
        waited = answer["at"] - killed
        assert answer["reply"].status_code == 200 and len(answer["reply"].json()["output_ids"]) == 3
        assert waited <= lease + 4, waited
        assert sup.continued and sup.continued[0]["url"] == url
        print(f"answered {waited:.1f}s after the kill (lease {lease:g}s)")
    finally:
        sup.stop()
    # no supervisor: the pause lasts until the next learner start repairs it
    journal.unlink(missing_ok=True)
    proc = _hang(url, toy_policy_dir, journal)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    time.sleep(2.0)
    assert _ready(url) == 503 and unfinished_push(journal) is not None
    logs: list[str] = []
    cfg = GRPOConfig(model=toy_policy_dir, output_dir=str(out), video_root=str(tmp_path), prompts_per_step=1,
                     group_size=2, max_new_tokens=16, save_every=100, concurrency=1, gating=False, resume=False,
                     backend="sglang", endpoint=url)
    learner = OnlineLearner(cfg, tmp_path / "traces.db", progress=False, log=logs.append)
    assert learner.run(once=True) == 0
    assert _ready(url) == 200 and not journal.exists()
    assert any("a push of version 7 (disk" in line and "never ended" in line for line in logs), logs
    events = [json.loads(x) for x in (out / "online_events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "push-repaired" and events[0]["servers"] == [url]
    reply = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}).json()
    assert reply["meta_info"]["weight_version"] == "0"  # the registry's serving version, pushed again


def test_a_restart_does_not_repair_a_push_whose_pusher_still_renews_its_lease(tmp_path, toy_policy_dir):
    """Two learners on one output directory: the second's start finds the first's journal with a lease that is
    being renewed (its pusher lives, another pid) and refuses to start, instead of continuing generation in the
    middle of that push. A journal whose lease stopped being renewed is a dead learner's: repaired (no servers
    named: nothing to continue)."""
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    cfg = GRPOConfig(model=toy_policy_dir, output_dir=str(tmp_path / "o"))
    learner = OnlineLearner(cfg, tmp_path / "t.db", progress=False, log=lambda *_: None)
    learner.trainer.setup()
    learner.journal.parent.mkdir(parents=True, exist_ok=True)
    learner.journal.write_text(json.dumps({"version": "4", "sync": "disk", "urls": [], "pid": os.getpid() + 1,
                                           "host": "h", "started": time.time()}))
    stop = threading.Event()

    def renew():  # what a live pusher's lease thread does
        while not stop.wait(0.3):
            os.utime(learner.journal)

    live = threading.Thread(target=renew, daemon=True)
    live.start()
    try:
        with pytest.raises(ConfigError, match="is renewing its lease: another learner or operator is pushing"):
            learner.repair_push()
    finally:
        stop.set()
        live.join()
    # the pusher died a moment ago: its lease is fresh but no longer renewed
    assert learner.repair_push()["version"] == "4" and not learner.journal.exists()
    events = [json.loads(x) for x in (tmp_path / "o" / "online_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["push-repaired"]


# --------------------------------------------------------------------------- one path for every push (issue 65)

#: the real journal of this release (:func:`journal_push`) written by a host whose clock is ``skew`` seconds off:
#: every time it reads, and every time it stamps on a file (or its disk does), is off by that much
SKEWED_PUSHER = textwrap.dedent("""
    import os, sys, time
    journal, skew, url = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    real_time, real_replace, real_utime = time.time, os.replace, os.utime
    time.time = lambda: real_time() + skew

    def stamp(path):
        t = time.time()
        real_utime(path, (t, t))

    def replace(src, dst, *a, **kw):
        real_replace(src, dst, *a, **kw)
        stamp(dst)

    def utime(path, times=None, *a, **kw):
        real_utime(path, times if times is not None else (time.time(), time.time()), *a, **kw)

    os.replace, os.utime = replace, utime
    from paravt_train.sync.lease import journal_push

    with journal_push(journal, [url], "7", "disk"):
        print("PUSHING", flush=True)
        time.sleep(3600)
""")

#: a pusher of 0.5.1 (its journal without a counter, renewed by its file time, no push lock) on a host whose clock
#: is ``skew`` seconds off
PUSHER_0_5_1 = textwrap.dedent("""
    import json, os, socket, sys, time
    journal, skew, url = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    os.makedirs(os.path.dirname(journal), exist_ok=True)
    with open(journal, "w") as f:
        json.dump({"version": "7", "sync": "disk", "urls": [url], "pid": os.getpid(), "host": socket.gethostname(),
                   "started": time.time() + skew}, f)
    print("PUSHING", flush=True)
    while True:
        t = time.time() + skew
        os.utime(journal, (t, t))
        time.sleep(1.0)
""")


def _start(script: str, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    if line.strip() not in ("PUSHING", "PAUSED", "READY"):
        proc.kill()
        raise AssertionError(f"{line!r}: {proc.stderr.read()[-3000:]}")
    return proc


def _paused_server(json_server):
    """A server paused by a push (``/ready`` 503 until ``/continue_generation``), recording when it was continued."""
    state: dict = {"paused": True}

    def reply(path, body):
        if path == "/ready":
            return (503 if state["paused"] else 200), {}
        if path == "/continue_generation":
            state["paused"], state["at"] = False, time.monotonic()
        return 200, {"success": True}

    return json_server(reply), state


@pytest.mark.parametrize("skew", [-90.0, 90.0], ids=["writer-90s-behind", "writer-90s-ahead"])
def test_the_lease_needs_no_clock_agreement(tmp_path, json_server, skew):
    """The supervisor times the journal's renewal counter with its own clock: a live push from a host whose clock
    is 90 s behind keeps its pause past the lease (before: cut after the lease, because its file times looked
    90 s old), and when that pusher is ``kill -9``ed — 90 s behind or 90 s ahead (before: a pause of 90 s + the
    lease) — generation continues within the lease and a poll."""
    srv, state = _paused_server(json_server)
    journal, lease = tmp_path / "out" / "push.json", 2.0
    proc = _start(SKEWED_PUSHER, journal, skew, srv.url)
    sup = PauseSupervisor([srv.url], lease=lease, lease_file=journal, poll=0.2, log=lambda *_: None).start()
    try:
        time.sleep(2 * lease + 1)
        assert state["paused"] and sup.continued == [], sup.continued  # the live push keeps its pause
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        while state["paused"] and time.monotonic() < killed + lease + 10:
            time.sleep(0.05)
        assert not state["paused"], "the dead pusher's pause outlived its lease"
        waited = state["at"] - killed
        assert waited <= lease + 1.0, waited
        assert sup.continued[0]["why"] == "lease" and unfinished_push(journal)["renewals"] >= 3
        print(f"skew {skew:+.0f}s: continued {waited:.1f}s after the kill (lease {lease:g}s)")
    finally:
        sup.stop()
        proc.kill()


def test_a_restart_refuses_to_repair_a_live_push_whatever_its_writers_clock(tmp_path, toy_policy_dir, json_server):
    """A pusher that does not take the push lock (0.5.1's) on a host 90 s behind keeps renewing its journal: the
    restarting learner watches the renewals with its own clock and refuses, continuing nothing (before: the file's
    time looked 90 s old, so it continued generation in the middle of that push). Once the pusher is ``kill -9``ed
    its journal is repaired: generation continued, the journal gone."""
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    srv = json_server(lambda path, body: (200, {"success": True}))
    out = tmp_path / "o"
    proc = _start(PUSHER_0_5_1, out / "push.json", -90.0, srv.url)
    try:
        learner = OnlineLearner(GRPOConfig(model=toy_policy_dir, output_dir=str(out)), tmp_path / "t.db",
                                progress=False, log=lambda *_: None)
        learner.trainer.setup()
        with pytest.raises(ConfigError, match=rf"version 7 by pid {proc.pid} .* is renewing its lease"):
            learner.repair_push()
        assert "/continue_generation" not in srv.paths  # nothing continued under a live push
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        left = learner.repair_push()
        assert left["version"] == "7" and left["continued"] == [srv.url] and not learner.journal.exists()
        assert srv.paths[-2:] == ["/continue_generation", "/end_weight_update"]
    finally:
        proc.kill()


#: a learner that has set up (holding its lock) and then idles, pushing nothing
IDLE_LEARNER = textwrap.dedent("""
    import sys, time
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    learner = OnlineLearner(GRPOConfig(model=sys.argv[1], output_dir=sys.argv[2]), sys.argv[3], progress=False,
                            log=lambda *_: None)
    learner.setup()
    print("READY", flush=True)
    time.sleep(3600)
""")


def test_one_learner_per_output_directory_and_store_for_its_whole_life(tmp_path, toy_policy_dir):
    """A learner holds its output directory and its store from set-up to its end, pushing or not: a second learner
    on the same directory, or on another directory with the same store, is refused at set-up naming the holder's
    pid and host (before: it started, unless the first happened to be mid-push). ``kill -9`` of the holder lets
    go: the next learner starts."""
    import socket

    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    store = tmp_path / "traces.db"
    first = _start(IDLE_LEARNER, toy_policy_dir, tmp_path / "a", store)
    try:
        for out in ("a", "b"):  # the same output directory; another one on the same store
            second = OnlineLearner(GRPOConfig(model=toy_policy_dir, output_dir=str(tmp_path / out)), store,
                                   progress=False, log=lambda *_: None)
            with pytest.raises(ConfigError, match=rf"another online learner .*pid {first.pid} on "
                                                  rf"{socket.gethostname()}"):
                second.setup()
            assert not second.trainer._ready  # refused before any model loads
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second.setup()  # the holder is gone
        assert json.loads((tmp_path / "b" / "learner.lock").read_text())["pid"] == os.getpid()
        second.close()
    finally:
        first.kill()


#: a learner's lock on a PostgreSQL store, held by another process (its connection open) until it is killed
PG_HOLDER = textwrap.dedent("""
    import sys, time
    from paravt_agent.store import TrajectoryStore
    from paravt_train.online.lock import LearnerLock

    lock = LearnerLock(sys.argv[1], TrajectoryStore(sys.argv[2])).acquire()  # held while referenced
    print("READY", flush=True)
    time.sleep(3600)
""")


def test_one_learner_per_postgres_store(tmp_path, postgres_db):
    """On PostgreSQL the store's lock is ``pg_try_advisory_lock`` on a connection the learner keeps: a second
    learner (another output directory, another host for all the database knows) is refused naming the holder's
    pid and host from ``pg_stat_activity``; the holder's ``kill -9`` ends its session and the lock with it."""
    from paravt_agent.store import TrajectoryStore
    from paravt_train.online.lock import LearnerLock, LearnerRunning

    holder = _start(PG_HOLDER, tmp_path / "a", postgres_db)
    store = TrajectoryStore(postgres_db)
    try:
        with pytest.raises(LearnerRunning, match=rf"paravt-learner pid={holder.pid} host="):
            LearnerLock(tmp_path / "b", store).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 20
        while True:  # the server notices the closed connection
            try:
                lock = LearnerLock(tmp_path / "b", store).acquire()
                break
            except LearnerRunning:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        lock.release()
    finally:
        holder.kill()
        store.close()


#: a push of this release from another process (an operator's command, or a learner), its load slow
SLOW_PUSHER = textwrap.dedent("""
    import sys
    from paravt_train.sync.disk import SGLangWeightSync

    print("PUSHING", flush=True)
    SGLangWeightSync(sys.argv[1], journal=sys.argv[2]).serve(sys.argv[3], "1")
""")


def test_two_pushers_wait_for_each_other_and_never_remove_each_others_journal(tmp_path, json_server):
    """The learner and an operator's command pushing from one output directory at once: the second waits for the
    first's push to end (one pause, load and continue after the other) and its own journal stays until its own
    push ends (before: both pushed at once, and the first to end removed the other's journal, leaving a push
    running with no lease and nothing to repair)."""
    journal = tmp_path / "out" / "push.json"
    seen: list = []

    def reply(path, body):
        if path == "/update_weights_from_disk":
            seen.append(("load", body["weight_version"], (unfinished_push(journal) or {}).get("version")))
            time.sleep(2.0)
            seen.append(("loaded", body["weight_version"], (unfinished_push(journal) or {}).get("version")))
        elif path in ("/pause_generation", "/continue_generation"):
            seen.append((path, None, None))
        return 200, {"success": True}

    srv = json_server(reply)
    other = _start(SLOW_PUSHER, srv.url, journal, tmp_path)
    deadline = time.monotonic() + 30
    while not any(s[0] == "load" for s in seen):
        assert time.monotonic() < deadline and other.poll() is None, other.stderr.read()[-2000:]
        time.sleep(0.05)
    said: list[str] = []
    SGLangWeightSync(srv.url, journal=journal, log=said.append).serve(tmp_path, "2")
    assert other.wait(30) == 0
    assert seen == [("/pause_generation", None, None), ("load", "1", "1"), ("loaded", "1", "1"),
                    ("/continue_generation", None, None), ("/pause_generation", None, None), ("load", "2", "2"),
                    ("loaded", "2", "2"), ("/continue_generation", None, None)], seen
    assert not journal.exists()


def _registry_with(tmp_path, model: str, history: list[tuple[str, str]]):
    """A real registry whose versions are ``model``'s weights, served in the order ``history`` gives."""
    from paravt_train.online.versions import VersionRegistry

    reg = VersionRegistry(tmp_path / "out" / "versions")
    for vid in dict.fromkeys(v for v, _ in history):
        reg.add(vid, int(vid[1:]), model, "candidate")
    for vid, why in history:
        reg.set_serving(vid, reason=why)
        time.sleep(0.01)
    return reg


def test_an_operator_rollback_never_restores_a_rolled_back_version_unless_named(tmp_path, toy_policy_dir):
    """v1 → v2 → rollback (v2 was worse) → v1 → v3: ``paravt-train online rollback`` with no version puts back v1,
    never the rolled-back v2 (before: v2, the newest promoted before v3); naming v2 puts it back, with a warning."""
    from typer.testing import CliRunner

    from paravt_train.online.cli import app

    reg = _registry_with(tmp_path, toy_policy_dir, [("v1", "promoted"), ("v2", "promoted"),
                                                    ("v1", "rollback: v2 worse"), ("v3", "promoted")])
    cfg = tmp_path / "online.yaml"
    cfg.write_text(f"model: {toy_policy_dir}\noutput_dir: {tmp_path / 'out'}\n")  # no server: recorded only
    res = CliRunner().invoke(app, ["rollback", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert reg.serving()["id"] == "v1" and reg.get("v3")["status"] == "rolled-back"
    res = CliRunner().invoke(app, ["rollback", "v2", "--config", str(cfg)])
    assert res.exit_code == 0 and "warning: v2 was rolled back" in res.output and reg.serving()["id"] == "v2"
    events = [json.loads(x)["event"] for x in (tmp_path / "out" / "online_events.jsonl").read_text().splitlines()]
    assert events == ["operator-rollback", "operator-rollback"]


def test_the_operators_next_push_repairs_a_journal_of_0_5_1(tmp_path, toy_policy_dir, json_server):
    """A journal left by a pusher of 0.5.1 (no counter) that died: the operator's ``promote`` finds it, sees its
    lease stand still, continues generation and closes the weight-update session on the servers it names, records
    the repair, and only then makes its own push (before: the operator's push simply went ahead of it)."""
    from typer.testing import CliRunner

    from paravt_train.online.cli import app

    srv = json_server(lambda path, body: (200, {"success": True, "weight_version": "1"}))
    journal = tmp_path / "out" / "push.json"
    _registry_with(tmp_path, toy_policy_dir, [("v0", "start"), ("v1", "promoted")])
    journal.write_text(json.dumps({"version": "9", "sync": "tensor", "urls": [srv.url], "pid": 1, "host": "gone",
                                   "started": 0.0}))
    cfg = tmp_path / "online.yaml"
    cfg.write_text(f"model: {toy_policy_dir}\noutput_dir: {tmp_path / 'out'}\nbackend: sglang\n"
                   f"endpoint: {srv.url}\n")
    res = CliRunner().invoke(app, ["promote", "v0", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "a push of version 9 (tensor, pid 1 on gone) never ended" in res.output
    before = srv.paths[:srv.paths.index("/pause_generation")]  # the repair, then the operator's own push
    assert before.index("/continue_generation") < before.index("/end_weight_update")
    events = [json.loads(x) for x in (tmp_path / "out" / "online_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["push-repaired", "operator-promote"] and events[0]["version"] == "9"
    assert not journal.exists()


#: ``paravt-train online ARGS``
OPERATOR = "import sys\nfrom paravt_train.online.cli import app\napp(sys.argv[1:], prog_name='paravt-train online')\n"

#: ``paravt-train online ARGS`` that hangs once a server is paused (what a command killed there leaves)
OPERATOR_HANG = PAUSE_THEN_HANG + textwrap.dedent("""
    from paravt_train.online.cli import app

    app(sys.argv[1:], prog_name="paravt-train online")
""")


def test_an_operator_rollback_killed_mid_push_is_repaired_on_the_next_start(tmp_path, toy_policy_dir, sglang_stub):
    """The SGLang stand-in serving v1. ``paravt-train online rollback`` is ``kill -9``ed with the server paused:
    its journal renews a counter while it lives (the supervisor's lease) and stays behind. The next ``rollback``
    finds it, waits out its lease by its own clock, continues generation, records the repair and then rolls back:
    the server answers on v0 and the registry says v0 serves."""
    srv = sglang_stub(toy_policy_dir)
    reg = _registry_with(tmp_path, toy_policy_dir, [("v0", "start"), ("v1", "promoted")])
    out, cfg = tmp_path / "out", tmp_path / "online.yaml"
    cfg.write_text(f"model: {toy_policy_dir}\noutput_dir: {out}\nbackend: sglang\nendpoint: {srv.url}\n")
    killed = _start(OPERATOR_HANG, "rollback", "--config", cfg)
    try:
        first = unfinished_push(out / "push.json")
        time.sleep(1.5)
        later = unfinished_push(out / "push.json")
        assert _ready(srv.url) == 503 and first["version"] == "0"
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
    finally:
        killed.kill()
    assert _ready(srv.url) == 503 and reg.serving()["id"] == "v1"  # paused; the rollback never recorded
    res = subprocess.run([sys.executable, "-c", OPERATOR, "rollback", "--config", str(cfg)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"a push of version 0 (disk, pid {killed.pid}" in res.stdout and "never ended" in res.stdout
    assert _ready(srv.url) == 200 and not (out / "push.json").exists()
    events = [json.loads(x) for x in (out / "online_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["push-repaired", "operator-rollback"]
    assert reg.serving()["id"] == "v0" and reg.get("v1")["status"] == "rolled-back"
    reply = httpx.post(srv.url + "/generate", timeout=120, json={
        "input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}).json()
    assert reply["meta_info"]["weight_version"] == "0"
    assert later["renewals"] > first["renewals"]  # the killed command's lease was renewed while it lived


def test_a_running_learner_repairs_an_operator_push_that_died_and_puts_its_version_back(tmp_path, toy_policy_dir,
                                                                                      json_server):
    """While the learner runs (each turn of its loop), a journal left by an operator's command that died: once its
    lease stands still, generation is continued, and under the same push lock the version the registry serves goes
    back on the server (the half-applied push is never taken for a version), the repair recorded."""
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    srv = json_server(lambda path, body: (200, {"success": True}))
    out = tmp_path / "out"
    cfg = GRPOConfig(model=toy_policy_dir, output_dir=str(out), backend="sglang", endpoint=srv.url)
    learner = OnlineLearner(cfg, tmp_path / "t.db", progress=False, log=lambda *_: None)
    learner.trainer.setup()
    _registry_with(tmp_path, toy_policy_dir, [("v0", "start"), ("v3", "promoted")])
    dead = _start(PUSHER_0_5_1, learner.journal, 0.0, srv.url)  # the operator's push of v0, then killed
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)
    left = learner.repair_push(restore=True)
    assert left["version"] == "7" and left["continued"] == [srv.url] and not learner.journal.exists()
    loads = [b for m, p, b in srv.seen if p == "/update_weights_from_disk"]
    assert [b["weight_version"] for b in loads] == ["3"]  # the registry's serving version, pushed back
    assert srv.paths.index("/end_weight_update") < srv.paths.index("/update_weights_from_disk")
    events = [json.loads(x) for x in (out / "online_events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "push-repaired" and "v3, the version that serves, goes back" in events[-1]["reason"]
    learner.close()


def test_an_operators_push_while_a_candidate_is_judged_stands(tmp_path, toy_policy_dir, json_server):
    """The learner decides on a candidate (or a rollback) against the version it knows serves; an operator's
    `promote` / `rollback` can land while it judges. Under the push lock the learner now looks again: a registry that
    moved means the operator's choice stands — the candidate is not pushed (recorded `superseded`), no rollback is
    pushed, and the learner continues from the operator's version. Before (found in review), the learner pushed its
    candidate, gated against v0 and trained from it, over the operator's v3."""
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    srv = json_server(lambda path, body: (200, {"success": True}))
    out = tmp_path / "out"
    cfg = GRPOConfig(model=toy_policy_dir, output_dir=str(out), backend="sglang", endpoint=srv.url)
    learner = OnlineLearner(cfg, tmp_path / "t.db", progress=False, log=lambda *_: None)
    learner.setup()
    reg = _registry_with(tmp_path, toy_policy_dir, [("v0", "start")])
    promotion = learner.promotion
    promotion.state.serving = "v0"  # what the learner last saw
    reg.set_serving("v0", reason="start")
    reg.add("v3", 3, toy_policy_dir, "candidate")
    reg.set_serving("v3", reason="operator-promote")  # the operator's push, landed meanwhile
    before = len(srv.seen)
    verdict = promotion.promote_candidate()
    assert not verdict["promote"] and "an operator's push while it was judged" in verdict["summary"]
    assert [p for _, p, _ in srv.seen[before:]] == []  # nothing pushed
    assert reg.serving()["id"] == "v3" and promotion.state.serving == "v3"
    events = [json.loads(x) for x in (out / "online_events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "superseded" and events[-1]["serving"] == "v3"
    # a rollback decided against v3 while the operator went back to v0: not pushed either
    reg.set_serving("v0", reason="operator-rollback")
    assert promotion.rollback_to(reg.get("v3"), "rollback: worse", judged="v3") is None
    assert [p for _, p, _ in srv.seen[before:]] == [] and reg.serving()["id"] == "v0"
    assert promotion.state.serving == "v0"
    learner.close()


def test_a_repair_that_cannot_release_a_server_keeps_the_journal(tmp_path, toy_policy_dir, json_server):
    """A dead push's repair that cannot continue generation on a server (it answers 503) and pushes nothing back
    keeps the journal: the pause supervisor still sees its dead lease, and the next pusher repairs again. Before
    (found in review) the journal was removed, and only `--max-pause` could end that server's pause."""
    from paravt_train.online.versions import repair_push
    from paravt_train.rl.config import GRPOConfig

    down = {"now": True}
    srv = json_server(lambda path, body: (503, {"error": "busy"}) if down["now"] else (200, {"success": True}))
    journal = tmp_path / "out" / "push.json"
    dead = _start(PUSHER_0_5_1, journal, 0.0, srv.url)
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)
    cfg = GRPOConfig(model=toy_policy_dir, output_dir=str(tmp_path / "out"), backend="sglang", endpoint=srv.url)
    left = repair_push(cfg, journal, log=lambda *_: None)
    assert left["kept"] and left["errors"] and not left["continued"] and journal.exists()
    down["now"] = False  # the server answers again: the next repair releases it and removes the journal
    left = repair_push(cfg, journal, log=lambda *_: None)
    assert not left["kept"] and left["continued"] == [srv.url] and not journal.exists()
