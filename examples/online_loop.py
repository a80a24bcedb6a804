"""Online learning from feedback on the toy: which way the served agent goes follows the users' labels, a gate
keeps poisoned updates away, and no single user can force a rollback.

    .venv/bin/python examples/online_loop.py                       # the six runs below (time: docs/toy.md)
    .venv/bin/python examples/online_loop.py --updates 6 --runs honest,wrong     # a quick look
    .venv/bin/python examples/online_loop.py --sglang     # the same six runs served by SGLang itself (CPU engine)

The start is the shipped toy policy made *systematically wrong* by a short SFT: on colour-at-t multiple-choice
questions it crops the video as usual, reads the right colour, and then answers the option after it most of
the time (``--bias``, 70 %). Format, tool use and every other reward term are the same whichever option it
names, so only the users' labels can say which option is right.

Each run starts a fresh trajectory store and learner from that start (registered as v0 and served before anyone
asks). Asking and learning alternate, as in production: scripted users ask the *served* agent ``4 ×
--promote-every`` colour-at-t questions about videos no training saw and give feedback (``Agent.feedback``, each
with a ``user``); then ``OnlineLearner`` (``paravt-train online``'s loop, in this process; rollouts in-process, or
on SGLang with ``--sglang``) runs ``--promote-every`` updates on it and gates (or serves) the candidate; the next
users ask whatever serves then. Every label is of an answer a known version gave, so it counts for that version's
live score and automatic rollback (``online.rollback``, at its defaults) can look:

* ``honest``: every label is the right option;
* ``wrong``: every label is a wrong option (the control: if the feedback's content did not matter, this would
  gain as much);
* ``adversarial``: two users in three are honest, one gives a wrong option as every label; no gate;
* ``adversarial+gate``: the same stream with the gate on (a pinned evaluation set of other held-out worlds,
  margin ``--margin``, by default the smallest its 20 questions can hold): a candidate worse than the served or
  the starting version is kept aside and the learner reverts;
* ``one-key-many-users``: the same attack through ``paravt api`` (on 127.0.0.1, ``--keys``: alice, bob, carol,
  dave and mallory each hold a key): mallory's key sends every label under a new ``user`` name. The learner counts
  principals — her key is one voter, its labels capped at ``max_labels_per_user`` — and the run prints the decision
  beside the one the same labels get when each user name is a voter (0.5.1 counted them so);
* ``rollback-attack``: an adversary tries to force a rollback of a good version. Four honest users label
  ``--attack-per-user`` answers each of v0 right; the learner makes and serves one candidate (no gate; lr
  ``--attack-lr``, by default so small that its answers are v0's: exactly as good, so any rollback of it would be
  a false one); then the honest users label as many of its answers right while ``mallory`` asks
  ``--attack-labels`` questions and labels every answer wrong; the learner's next update takes the rollback's
  look. The run prints the decision and the same labels under the old rule (accuracy below the last version's
  − 0.1 on ≥ 20 labels, counted before any per-user limit), without the per-user cap, and from mallory alone.

With ``--sglang`` the users' agent and the learner's rollouts go to SGLang 0.5.23's own server (its CPU engine,
``make sglang-cpu``; started once with ``paravt serve``'s launcher, pinned to core 0, the learner on core 1),
backend ``sglang`` as ``paravt-train online`` runs it in production: the server holds the served version (each
learner puts its v0 back on it first), a promotion pushes a version from disk, the learner trains ahead of it and
corrects for the gap with decoupled PPO's behaviour weights. The held-out and gate evaluations stay in-process
(the trainer's transformers model; ``perf/bench_parity.py`` measures how closely SGLang matches it).

After each run the held-out accuracy (greedy, n = 8, worlds of ``--seed`` on, disjoint from the users' and the
gate's) of every version that served is measured; the table prints accuracy through the run, the final gain with
its paired 95% interval, the gate's decision on each candidate and the rollback's looks and rollbacks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paravt_agent.agent import Agent  # noqa: E402
from paravt_agent.protocol import LETTERS, option_body  # noqa: E402
from paravt_agent.store import TrajectoryStore  # noqa: E402
from paravt_train.data import write_parquet  # noqa: E402
from paravt_train.eval.stats import mean_ci, paired_diff_ci  # noqa: E402
from paravt_train.online.config import OnlineConfig, RollbackSettings  # noqa: E402
from paravt_train.online.gate import evaluate_dir  # noqa: E402
from paravt_train.online.learner import OnlineLearner  # noqa: E402
from paravt_train.online.promotion import live_counts, rollback_decision  # noqa: E402
from paravt_train.rewards import accuracy_reward  # noqa: E402
from paravt_train.sft import train  # noqa: E402
from paravt_train.sft.config import SFTConfig  # noqa: E402
from paravt_train.toy.build import TEST_SEED0, toy_agent_config  # noqa: E402
from paravt_train.toy.quickstart import REPO_CHECKPOINT  # noqa: E402
from paravt_train.toy.rows import rl_rows  # noqa: E402
from paravt_train.toy.world import make_worlds, parallel_trace  # noqa: E402
from tools import ToolRegistry  # noqa: E402

BIASED_SEED0 = 710_000  # the biased start's SFT worlds
USER_SEED0 = 810_000  # the users' videos
GATE_SEED0 = TEST_SEED0 + 8000  # the gate's pinned evaluation set
RUNS = ("honest", "wrong", "adversarial", "adversarial+gate", "rollback-attack", "one-key-many-users")
HONEST = ("alice", "bob", "carol", "dave")  # the rollback attack's honest users
ATTACK_SEED0 = 830_000  # the rollback attack's videos


def biased_start(model: str, out: Path, bias: float, steps: int = 120, worlds: int = 60) -> Path:
    """The toy policy answering the option after the right one in ``bias`` of its SFT traces (cached)."""
    if (out / "config.json").is_file():
        return out
    work = out.with_name(out.name + ".build")
    rng = random.Random(0)
    ws = make_worlds(range(BIASED_SEED0, BIASED_SEED0 + worlds), work / "videos", False, mcq=3, oe=0, tvg=0)
    schema = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()
    rows = []
    for w in ws:
        for q in w.questions:
            msgs = parallel_trace(w, q, w.video, rng.choice((4, 8, 16)), schema)
            if rng.random() < bias:  # the next option's colour instead of the right one
                right = LETTERS.index(q.answer)
                wrong = option_body(q.options[(right + 1) % len(q.options)]).strip()
                text = msgs[-1]["content"]
                msgs[-1] = {**msgs[-1], "content": text[: text.rindex("<answer>")] + f"<answer> {wrong}</answer>"}
            rows.append({"id": q.qid, "messages": msgs})
    data = write_parquet(rows, work / "sft.parquet")
    cfg = SFTConfig(model=model, data=str(data), output_dir=str(work / "sft"), frames=toy_agent_config().frames,
                    lr=5e-4, batch_size=8, micro_batch_size=1, max_steps=steps, warmup_ratio=0.1, save_every=0,
                    seed=0, resume=False)
    train(cfg, progress=False)
    shutil.copytree(work / "sft" / "final", out, dirs_exist_ok=True)
    return out


def prompts_parquet(worlds, path: Path) -> Path:
    return write_parquet(rl_rows(worlds, path.parent), path)


def served_agent(start: Path, store: TrajectoryStore, learner: OnlineLearner, endpoint: str | None) -> Agent:
    """The agent users ask: on SGLang the server holds the served version; in-process, the served version's
    weights (the registry's serving version, loaded again each round)."""
    cfg8 = toy_agent_config().model_copy(
        update={"frames": toy_agent_config().frames.model_copy(update={"n_frames": 8})})
    if endpoint:
        return Agent(model=str(start), config=cfg8, store=store, backend="sglang", endpoint=endpoint)
    return Agent(model=learner.registry.serving()["path"], config=cfg8, store=store)


def ask(agent: Agent, learner: OnlineLearner, questions, labeller, labels: list, api=None) -> None:
    """Each ``(user, world, question)`` asked of the served agent; the user's label (``labeller``) is fed back and
    recorded in ``labels`` with the version that served the answer and the answer's score under it. ``api``: the
    label goes through ``paravt api``'s ``/v1/feedback`` instead (:class:`FeedbackApi`)."""
    from paravt_agent.store.feedback import task_of

    serving = learner.registry.serving()["id"]
    for k, (user, w, q) in enumerate(questions):
        ans = agent.answer(w.video, q.question, q.options)
        label = labeller(user, q, ans)
        if api is None:
            agent.feedback(ans.trace.id, answer=label, user=user)
            who, name = f"sdk:{user}", f"sdk:{user}"
        else:
            who, name = api.post(user, ans.trace.id, label, k)
        score = accuracy_reward(ans.trace.response, label, task_of(ans.trace), ans.trace.options)
        labels.append({"version": serving, "user": who, "name": name, "score": score, "right": label == q.answer})


class FeedbackApi:
    """``paravt api`` (its app, served by uvicorn in a thread on 127.0.0.1) with a keys file: each of ``users``
    holds a key; mallory's key sends each label under a new ``user`` name, the others under one each."""

    def __init__(self, store: TrajectoryStore, users, d: Path):
        import socket
        import threading

        import uvicorn

        from paravt_agent.policy.scripted import ScriptedPolicy
        from paravt_agent.serving.api import ApiSettings, create_app

        self.keys = {u: f"key-{u}-{os.urandom(6).hex()}" for u in users}
        (d / "keys.yaml").write_text("".join(f"{u}: {k}\n" for u, k in self.keys.items()))
        app = create_app(Agent(policy=ScriptedPolicy(lambda role, msgs: ""), store=store),  # feedback only
                         ApiSettings(keys=str(d / "keys.yaml")))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.05)

    def post(self, user: str, trace_id: str, label: str, k: int) -> tuple[str, str]:
        """The label, over HTTP with ``user``'s key: (the principal it counts for, the user name it was sent
        under)."""
        import httpx

        name = f"{user}-{k}" if user == "mallory" else f"{user}-phone"
        r = httpx.post(self.url + "/v1/feedback", json={"trace_id": trace_id, "answer": label, "user": name},
                       headers={"Authorization": f"Bearer {self.keys[user]}"}, timeout=30)
        r.raise_for_status()
        return f"key:{user}", f"key:{user}/{name}"

    def close(self) -> None:
        self.server.should_exit = True


def new_learner(name: str, start: Path, store: TrajectoryStore, d: Path, args, endpoint, online: dict, log,
                lr: float | None = None) -> OnlineLearner:
    backend = {"backend": "sglang", "endpoint": endpoint} if endpoint else {}
    cfg = OnlineConfig(model=str(start), output_dir=str(d / "learner"), video_root=str(d.parent / "videos"),
                     prompts_per_step=4, group_size=8, temperature=0.7, lr=lr or args.lr, max_new_tokens=256,
                     subagent_max_new_tokens=32, micro_batch_size=1, save_every=100, concurrency=4,
                     gating_choices=[4, 8], resume=False, seed=args.rl_seed, online=online, **backend)
    learner = OnlineLearner(cfg, store.path, progress=False, log=log)
    learner.run(max_steps=0)  # the starting version serves (v0) before the first user asks
    return learner


def run(name: str, start: Path, users, out: Path, args, gate_set: Path, vids: Path, endpoint: str | None) -> dict:
    """One online run, asking and learning in turn: the users ask the served agent ``promote_every × 4``
    questions and label them, then the learner runs ``promote_every`` updates on the labels and gates (or serves)
    the candidate; the next round's users ask whatever serves then. Returns the versions, the learner's log and
    the labels."""
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    store = TrajectoryStore(d / "traces.db")
    online = {"promote_every": args.promote_every, "max_user_share": 0.5}  # rollback on, at its defaults
    if name.endswith("+gate"):
        online["gate"] = {"enabled": True, "eval_set": str(gate_set), "video_root": str(vids), "n_frames": 8,
                          **({"margin": args.margin} if args.margin is not None else {})}
    lines: list[str] = []
    t0 = time.time()
    learner = new_learner(name, start, store, d, args, endpoint, online, lines.append)
    rng = random.Random(name)

    def labeller(user, q, ans):
        honest = name == "honest" or (name.startswith("adversarial") and user != "user2")
        return q.answer if honest else rng.choice([x for x in LETTERS[: len(q.options)] if x != q.answer])

    questions = [(f"user{k % 3}", w, q) for k, (w, q) in enumerate((w, q) for w in users for q in w.questions)]
    per_round = args.promote_every * 4
    labels: list = []
    for r in range(0, len(questions), per_round):
        ask(served_agent(start, store, learner, endpoint), learner, questions[r: r + per_round], labeller, labels)
        learner.run(max_steps=args.promote_every, once=True)
    return finish(learner, lines, labels, t0, d)


def attack(start: Path, users, out: Path, args, endpoint: str | None, name: str = "rollback-attack") -> dict:
    """An adversary tries to force a rollback of a good version. ``HONEST`` users label ``--attack-per-user``
    answers of the starting version v0 right; the learner makes one candidate (``--attack-lr``, by default so small
    that its answers are v0's: a version exactly as good, so any rollback of it is a false one) and serves it (no
    gate); then the honest users label as many of its answers right, and ``mallory`` asks ``--attack-labels``
    questions and labels every answer wrong (an option other than the one the agent named). The learner's
    next update checks the rollback (defaults: ``online.rollback``). ``one-key-many-users``: every label goes through
    ``paravt api`` with its user's key (:class:`FeedbackApi`), mallory's under a new ``user`` name each time."""
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    store = TrajectoryStore(d / "traces.db")
    lines: list[str] = []
    t0 = time.time()
    learner = new_learner(name, start, store, d, args, endpoint, {"promote_every": args.promote_every,
                                                                  "max_user_share": 0.5}, lines.append,
                          lr=args.attack_lr)
    rng = random.Random(name)

    def labeller(user, q, ans):
        if user != "mallory":
            return q.answer
        return rng.choice([x for x in LETTERS[: len(q.options)] if x != ans.choice])

    qs = [(w, q) for w in users for q in w.questions]
    k = args.attack_per_user
    labels: list = []
    api = FeedbackApi(store, (*HONEST, "mallory"), d) if name == "one-key-many-users" else None
    try:
        first = [(u, *qs[i * k + j]) for j in range(k) for i, u in enumerate(HONEST)]
        ask(served_agent(start, store, learner, endpoint), learner, first, labeller, labels, api)
        learner.run(max_steps=args.promote_every, once=True)  # v<promote_every>: promoted, serves
        off = len(HONEST) * k
        second = [(u, *qs[off + i * k + j]) for j in range(k) for i, u in enumerate(HONEST)]
        second += [("mallory", *qs[off + j % (len(HONEST) * k)]) for j in range(args.attack_labels)]
        rng.shuffle(second)
        ask(served_agent(start, store, learner, endpoint), learner, second, labeller, labels, api)
    finally:
        if api is not None:
            api.close()
    learner.run(max_steps=1, once=True)  # polls the labels, one update, the rollback's look
    return finish(learner, lines, labels, t0, d)


def finish(learner: OnlineLearner, lines: list[str], labels: list, t0: float, d: Path) -> dict:
    (d / "learner.log").write_text("\n".join(lines) + "\n")
    events_file = learner.trainer.out / "online_events.jsonl"
    events = [json.loads(x) for x in events_file.read_text().splitlines()] if events_file.is_file() else []
    return {"versions": learner.registry.versions(), "served": [v["path"] for v in learner.registry.promoted()],
            "serving": learner.registry.serving()["id"], "events": events, "margin": learner.promotion.margin,
            "looks": [x for x in lines if x.startswith("rollback")], "live": learner.state.live,
            "labels": labels, "minutes": (time.time() - t0) / 60}


def gate_text(r: dict) -> str:
    """The gate's decision on each candidate (or that every candidate was served as it came)."""
    out = []
    for e in r["events"]:
        g = e.get("gate") or {}
        if e["event"] not in ("promoted", "refused"):
            continue
        if "lower" not in g:
            out.append(f"{e['version']} served (no gate)")
            continue
        start = g.get("start") or {}
        worst = min(g["lower"], start.get("lower", g["lower"]))
        out.append(f"{e['version']} {e['event']} {g['candidate']:.2f} vs {g['served']:.2f}"
                   + (f", start {g['candidate'] - start['diff']:.2f}" if start else "")
                   + f" (lower {worst:+.2f} {'≥' if e['event'] == 'promoted' else '<'} −{g['margin']:.3f})")
    return "; ".join(out) or "no candidate"


def rollback_text(r: dict) -> str:
    """Rollback: each look the learner took and each rollback, or why none was taken (labels counted per version)."""
    rolled = [e for e in r["events"] if e["event"] == "rolled-back"]
    if r["looks"]:
        text = "; ".join(x.split(": ", 1)[1] if x.startswith("rollback look") else x for x in r["looks"])
    else:
        counted = {v: sum(c[2] for c in live_counts(r["live"][v]).values()) for v in r["live"]}
        text = ("no look (" + ", ".join(f"{v}: {n} labels" for v, n in counted.items())
                + f"; the first look needs {RollbackSettings().min_rows})")
    return text + (f"; ROLLED BACK to {', '.join(e['version'] for e in rolled)}" if rolled else "; none rolled back")


def summarise(name: str, r: dict, before: list, heldout) -> dict:
    curve = [mean_ci(heldout(p))[0] for p in r["served"]]
    serving = next(v["path"] for v in r["versions"] if v["id"] == r["serving"])
    after = heldout(serving)
    refused = [v["id"] for v in r["versions"] if v["status"] == "refused"]
    out = {"curve": curve, "gain": paired_diff_ci(before, after), "after": mean_ci(after), "refused": refused,
           "candidates": sum(e["event"] in ("promoted", "refused") for e in r["events"]), "minutes": r["minutes"],
           "gate": gate_text(r), "rollback": rollback_text(r), "margin": r["margin"], "serving": r["serving"]}
    if name == "rollback-attack":
        out["attack"] = attack_analysis(r)
    elif name == "one-key-many-users":
        out["attack"] = names_analysis(r)
    print(f"{name}: held-out of each served version {' → '.join(f'{x:.2f}' for x in curve)}, serving "
          f"{r['serving']} at the end; gate: {out['gate']}; rollback: {out['rollback']}; {r['minutes']:.1f} min",
          flush=True)
    if "attack" in out:
        print("  " + "\n  ".join(out["attack"]), flush=True)
    return out


def attack_analysis(r: dict) -> list[str]:
    """Why the attacked version stayed (or did not): the same labels under the old rule, without the per-user cap,
    from the adversary alone, and as the learner counted them."""
    promoted = [e["version"] for e in r["events"] if e["event"] == "promoted"]
    if not promoted:
        return ["no version was promoted: nothing to attack"]
    v0, v1 = r["versions"][0]["id"], promoted[0]
    rs = RollbackSettings()

    def uncapped(vid, only=None):
        c: dict = {}
        for x in r["labels"]:
            if x["version"] == vid and (only is None or x["user"] == only):
                a = c.setdefault(x["user"], [0.0, 0.0, 0])
                a[0], a[1], a[2] = a[0] + x["score"], a[1] + x["score"] ** 2, a[2] + 1
        return c

    def acc(c):
        n = sum(x[2] for x in c.values())
        return sum(x[0] for x in c.values()) / n if n else 0.0, n

    all1, all0 = uncapped(v1), uncapped(v0)
    (a1, n1), (a0, n0) = acc(all1), acc(all0)
    mal = uncapped(v1, "sdk:mallory")
    honest1 = {u: c for u, c in all1.items() if u != "sdk:mallory"}
    old = n1 >= 20 and n0 >= 20 and a1 < a0 - 0.1
    counted = live_counts(r["live"].get(v1))
    lines = [
        f"{v1}'s labels: {n1} ({mal.get('sdk:mallory', [0, 0, 0])[2]} from mallory, all wrong), live accuracy "
        f"{a1:.2f}; honest users alone {acc(honest1)[0]:.2f} on {acc(honest1)[1]}; {v0}: {a0:.2f} on {n0}",
        f"old rule (accuracy < before − 0.1, ≥ 20 labels each, counted before any per-user limit): "
        f"{'ROLLBACK' if old else 'kept'} ({a1:.2f} vs {a0:.2f})",
        f"the new test without the per-user cap: {rollback_decision(all1, all0, rs).why}",
        f"mallory's labels alone: {rollback_decision(mal, all0, rs).why}",
        f"as the learner counted them (after max_labels_per_user {rs.max_labels_per_user}): "
        f"{sum(c[2] for c in counted.values())} labels from {len(counted)} users, "
        f"{rollback_decision(counted, live_counts(r['live'].get(v0)), rs).why}",
    ]
    return lines


def names_analysis(r: dict) -> list[str]:
    """One key, many user names: the labels as the learner counted them (one voter per key) beside the same labels
    counted with each user name a voter (0.5.1's counting), under the same rule."""
    promoted = [e["version"] for e in r["events"] if e["event"] == "promoted"]
    if not promoted:
        return ["no version was promoted: nothing to attack"]
    v0, v1 = r["versions"][0]["id"], promoted[0]
    rs = RollbackSettings()

    def counted(vid, by):
        c: dict = {}
        for x in r["labels"]:
            if x["version"] == vid:
                a = c.setdefault(x[by], [0.0, 0.0, 0])
                if a[2] < rs.max_labels_per_user:
                    a[0], a[1], a[2] = a[0] + x["score"], a[1] + x["score"] ** 2, a[2] + 1
        return c

    names = {x["name"] for x in r["labels"] if x["version"] == v1 and x["user"] == "key:mallory"}
    learner = live_counts(r["live"].get(v1))
    per_name = counted(v1, "name")
    return [
        f"{v1}: mallory's one key sent {sum(x['user'] == 'key:mallory' for x in r['labels'] if x['version'] == v1)} "
        f"labels (all wrong) under {len(names)} user names",
        f"as the learner counted them (principals; max_labels_per_user {rs.max_labels_per_user}): "
        f"{sum(c[2] for c in learner.values())} labels from {len(learner)} principals: "
        f"{rollback_decision(learner, live_counts(r['live'].get(v0)), rs).why}",
        f"each user name a voter (0.5.1's counting): {sum(c[2] for c in per_name.values())} labels from "
        f"{len(per_name)} users: {rollback_decision(per_name, counted(v0, 'name'), rs).why}",
    ]


def serve(start: Path, out: Path, python: str):
    """SGLang's own server with the start, pinned to one core (this process to another): (process, URL)."""
    from paravt_agent.serving.sglang_launch import launch, sglang_command
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    two = len(cores) > 1 and shutil.which("taskset")
    if two:
        os.sched_setaffinity(0, {cores[1]})
        torch.set_num_threads(1)
    else:
        print("note: fewer than 2 cores or no taskset: the server and the learner share the machine unpinned")
    argv, env = sglang_command(str(start), "127.0.0.1", port, device="cpu", python=python, max_total_tokens=32768,
                               extra=["--skip-server-warmup", "--log-level", "warning"], vlm_cache_mb=0)
    env = {**env, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    with (out / "server.log").open("w") as f:
        proc = launch([*(["taskset", "-c", str(cores[0])] if two else []), *argv], env, "127.0.0.1", port,
                      timeout=300, log=f)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT), help="The toy policy (default: checkpoints/toy).")
    ap.add_argument("--out", default="runs/online_loop")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"Which of {', '.join(RUNS)}.")
    ap.add_argument("--bias", type=float, default=0.7, help="Share of the start's SFT answers shifted one option.")
    ap.add_argument("--updates", type=int, default=12, help="Updates per run (4 prompts each).")
    ap.add_argument("--promote-every", type=int, default=3, help="Updates per candidate.")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--margin", type=float, default=None, help="The gate's non-inferiority margin (default: the "
                    "smallest its 20 pinned questions can hold, 0.33; a smaller one is refused at start).")
    ap.add_argument("--seed", type=int, default=TEST_SEED0 + 7000, help="First seed of the held-out worlds.")
    ap.add_argument("--rl-seed", type=int, default=0, help="The learner's seed (gating, rollout sampling; SGLang's "
                    "CPU engine ignores sampling seeds).")
    ap.add_argument("--attack-per-user", type=int, default=10, help="rollback-attack: answers each honest user "
                    "labels per version (the default max_labels_per_user: all of them count).")
    ap.add_argument("--attack-labels", type=int, default=40, help="rollback-attack: answers the adversary asks for "
                    "and labels wrong.")
    ap.add_argument("--attack-lr", type=float, default=1e-9, help="rollback-attack: the learner's lr (the default "
                    "leaves the answers of the attacked version the start's: it is exactly as good).")
    ap.add_argument("--eval-worlds", type=int, default=20, help="Held-out worlds (2 MCQ each).")
    ap.add_argument("--sglang", action="store_true", help="Serve and roll out with SGLang itself (its CPU engine).")
    ap.add_argument("--sglang-python", default=str(ROOT / ".venv-sglang" / "bin" / "python"),
                    help="The Python that has SGLang (default: the suite's .venv-sglang, `make sglang-cpu`).")
    args = ap.parse_args()
    if args.sglang and not Path(args.sglang_python).exists():
        raise SystemExit(f"{args.sglang_python} does not exist: `make sglang-cpu` installs SGLang's CPU engine")
    out = Path(args.out)
    t_all = time.time()
    vids = out / "videos"
    start = biased_start(args.model, out / "start", args.bias)
    held = make_worlds(range(args.seed, args.seed + args.eval_worlds), vids, False, mcq=2, oe=0, tvg=0)
    gate_w = make_worlds(range(GATE_SEED0, GATE_SEED0 + 10), vids, False, mcq=2, oe=0, tvg=0)
    users = make_worlds(range(USER_SEED0, USER_SEED0 + args.updates * 2), vids, False, mcq=2, oe=0, tvg=0)
    held_set, gate_set = prompts_parquet(held, vids / "held.parquet"), prompts_parquet(gate_w, vids / "gate.parquet")
    from paravt_train.data import prompts_from_rl

    held_prompts = prompts_from_rl(held_set, vids)
    cfg8 = toy_agent_config().model_copy(
        update={"frames": toy_agent_config().frames.model_copy(update={"n_frames": 8})})
    cache: dict[str, list] = {}

    def heldout(path) -> list:
        if str(path) not in cache:
            cache[str(path)] = evaluate_dir(path, cfg8, held_prompts)
        return cache[str(path)]

    before = heldout(start)
    print(f"start ({args.bias:.0%} biased): held-out {mean_ci(before)[0]:.2f} on {len(before)} questions")
    server, endpoint = (serve(start, out, args.sglang_python) if args.sglang else (None, None))
    results = {}
    try:
        for name in args.runs.split(","):
            if name in ("rollback-attack", "one-key-many-users"):
                need = len(HONEST) * args.attack_per_user  # questions per round (2 a world)
                worlds = make_worlds(range(ATTACK_SEED0, ATTACK_SEED0 + need), vids, False, mcq=2, oe=0, tvg=0)
                r = attack(start, worlds, out, args, endpoint, name)
            else:
                r = run(name, start, users, out, args, gate_set, vids, endpoint)
            results[name] = summarise(name, r, before, heldout)
    finally:
        if server is not None:
            from paravt_agent.serving.sglang_launch import stop

            stop(server)
    print("\n| run | held-out accuracy, each served version | after (95% CI) | gain (paired 95% CI) | "
          "the gate's decisions | rollback | minutes |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        a, g = r["after"], r["gain"]
        print(f"| {name} | {' → '.join(f'{x:.2f}' for x in r['curve'])} | {a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}] | "
              f"{g[0]:+.2f} [{g[1]:+.2f}, {g[2]:+.2f}] | {r['gate']} | {r['rollback']} | {r['minutes']:.1f} |")
    for name, r in results.items():
        if "attack" in r:
            print(f"\n{name}:\n- " + "\n- ".join(r["attack"]))
    margins = {r["margin"] for r in results.values() if r["margin"] is not None}
    print(f"\n{len(before)} held-out questions (seeds {args.seed}-{args.seed + args.eval_worlds - 1}); "
          f"{args.updates} updates of 4 prompts, users asking {args.promote_every * 4} questions before every "
          f"{args.promote_every} updates (a candidate each); "
          + (f"gate margin {', '.join(f'{m:.3f}' for m in margins)} (20 pinned questions); " if margins else "")
          + f"{'served by SGLang 0.5.23 (CPU engine, core 0), learner on core 1' if args.sglang else 'in-process'}; "
          f"{(time.time() - t_all) / 60:.1f} min in all")
    (out / "results.json").write_text(json.dumps({"before": before, **results}, indent=1, default=str))


if __name__ == "__main__":
    main()
