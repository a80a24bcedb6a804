"""The PARA-GRPO trainer: presets, one real update, exact resume, sub-agent sequences, weight sync, online learning."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paravt_agent.errors import PolicyError
from paravt_agent.store import TrajectoryStore
from paravt_agent.trajectory import Trace
from paravt_train.data import prompts_from_rl
from paravt_train.eval.plot import plot
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.trainer import GRPOTrainer, UpdateItem
from paravt_train.sync.disk import SGLangWeightSync
from paravt_train.sync.streamed import SGLangTensorSync


def _cfg(toy_policy_dir, toy_rl, out, **kw) -> GRPOConfig:
    base = dict(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"], output_dir=str(out),
                steps=1, prompts_per_step=2, group_size=2, max_new_tokens=96, subagent_max_new_tokens=40,
                temperature=0.7, lr=1e-3, save_every=1, concurrency=2)
    base.update(kw)
    return GRPOConfig(**base)


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def on_cpu(monkeypatch):
    """The trainer on the CPU, on a GPU machine too (a no-op without one), for claims of bit-exactness that are the
    algorithm's (a resume continues exactly, η = 0 is the synchronous loop, two FSDP2 ranks update like one
    process): CUDA's backward kernels (cuDNN convolutions, SDPA's atomics) are not deterministic, and the local
    batcher's batches are not batch-invariant in bf16 there (docs/performance.md, "Numerics by dtype and device")."""
    if torch.cuda.is_available():
        monkeypatch.setattr("paravt_train.rl.trainer.device", lambda: torch.device("cpu"))


def test_presets_and_overrides(tmp_path):
    """Each method's settings (the think prefix an agent setting the method sets), every component switchable on
    top of a method (the paper's ablations), and 0.4's keys still read, each with a warning naming the new key."""
    import warnings

    from paravt_train.methods import agent_config_for

    para = GRPOConfig(model="m")
    assert (para.method, para.gating, para.reward.anchor, para.reward.answer_suffix, para.reward.reward_bias) == (
        "para-grpo", True, True, True, -0.2)
    assert agent_config_for(para).think_prefix == "<think>\n"
    # vanilla GRPO: the whole of Exploration Anchoring off (Table 2), answer suffix included
    van = GRPOConfig(model="m", method="vanilla-grpo")
    assert (van.gating, van.reward.anchor, van.reward.answer_suffix) == (False, False, False)
    assert agent_config_for(van).think_prefix == ""
    dapo = GRPOConfig(model="m", method="dapo")
    assert (dapo.aggregation, dapo.clip_high, dapo.dynamic_sampling, dapo.kl_coef) == ("token-mean", 0.28, True, 0.0)
    # every component switchable on top of a method (the paper's ablations), the think prefix too
    abl = GRPOConfig(model="m", method="vanilla-grpo", gating=True, agent={"think_prefix": "<think>\n"})
    assert abl.gating and not abl.reward.anchor and agent_config_for(abl).think_prefix == "<think>\n"
    f = tmp_path / "c.yaml"
    f.write_text("model: m\nmethod: para-grpo\n")
    assert GRPOConfig.from_yaml(f, ["method=vanilla-grpo"]).reward.anchor is False
    assert agent_config_for(GRPOConfig.from_yaml(f, ["agent.think_prefix=''"])).think_prefix == ""
    assert GRPOConfig.from_yaml(f, ["reward.gamma=0"]).reward.gamma == 0
    from paravt_agent.errors import ConfigError

    with pytest.raises(ConfigError):
        GRPOConfig.from_yaml(f, ["no_such_field=1"])
    with pytest.raises(ConfigError, match="unknown method|method"):
        GRPOConfig.from_yaml(f, ["method=grpo-9000"])
    # 0.4's YAML: `preset` and `think_prefix` load as `method` and `agent.think_prefix`, the last given wins
    old = tmp_path / "old.yaml"
    old.write_text("model: m\npreset: para-grpo\nthink_prefix: ''\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = GRPOConfig.from_yaml(old, ["preset=vanilla-grpo"])
    assert cfg.method == "vanilla-grpo" and cfg.agent == {"think_prefix": ""}
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert any("`preset` is renamed `method`" in m for m in said)
    assert any("`think_prefix` is renamed `agent.think_prefix`" in m for m in said)


def test_paper_config_loads():
    root = Path(__file__).resolve().parents[1]
    cfg = GRPOConfig.from_yaml(root / "examples" / "configs" / "paragrpo_qwen3vl_8b.yaml")
    assert (cfg.lr, cfg.temperature, cfg.group_size, cfg.max_new_tokens, cfg.kl_coef, cfg.clip) == (
        2e-6, 0.7, 8, 2048, 0.01, 0.2)
    r = cfg.reward
    assert (r.reward_bias, r.lambda_fmt, r.lambda_anchor, r.alpha, r.beta, r.gamma) == (-0.2, 1.0, 0.5, 0.4, 0.3, 0.3)
    assert cfg.gating_choices == [4, 8, 16, 32, 64] and cfg.backend == "sglang"


@pytest.mark.dtype
@pytest.mark.parametrize("subagents", [True, False])
def test_one_update_changes_the_policy_and_logs(toy_policy_dir, toy_rl, tmp_path, subagents, dtype, numeric_bound,
                                                record_property):
    # G = 4 at tau = 1.5: rollouts of a prompt differ in reward (a gradient exists; the toy policy is confident,
    # at tau = 1 all its groups can agree). The dtype under test is the trainer's autocast (bf16: as on a GPU)
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "run", train_subagents=subagents, steps=2,
                          group_size=4, temperature=1.5, bf16="true" if dtype == "bfloat16" else "false"),
                     progress=False)
    tr.setup()
    before = _weights(tr.model)
    ref_before = _weights(tr.ref)
    summary = tr.run()
    after = _weights(tr.model)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        for key in ("reward", "f_tau", "kappa", "closure/think", "closure/answer", "accuracy", "kl", "clip_fraction",
                    "entropy", "rollout_seconds", "update_seconds", "reward/acc", "reward/fmt", "reward/tool",
                    "grad_norm_max", "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2", "mismatch/past_threshold",
                    "mismatch/ppl_ratio", "mismatch/truncated"):
            assert key in r, key
        for key in ("mismatch/kl_k3", "mismatch/chi2", "mismatch/ppl_ratio", "mismatch/past_threshold"):
            record_property(f"{key}_step_{r['step']}", r[key])
        # in-process rollouts: the engine is the trainer, so its distribution is the trainer's to the dtype's rounding;
        # bf16: the bound at the sampled tokens' mean 1 − p (mismatch/uncertainty)
        bound = numeric_bound("update", toy_policy_dir)
        limit = bound.at(math.log(1 - r["mismatch/uncertainty"]))
        bound.check(record_property, r["logprob_mismatch"], limit)
        assert r["mismatch/kl_k3"] < limit
        assert r["mismatch/past_threshold"] <= (0.0 if dtype == "float32" else 0.01)
        assert len(r["prompts"]) == 2 and 4 <= r["n_frames"] <= 64  # gated: n from {4, ..., 64} per prompt
        record_property(f"logprob_mismatch_step_{r['step']}", r["logprob_mismatch"])
        # the trainer scores what was sampled, as sampled (in-process rollouts run under the trainer's autocast)
        assert r["logprob_mismatch"] < limit
    assert any(r["zero_std_groups"] < 2 for r in recs)  # some group's rewards differ: a gradient exists
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(ref_before[k], v) for k, v in _weights(tr.ref).items())  # the reference stays frozen
    seqs = [r["sequences"] for r in recs]
    if subagents:
        assert any(s > 8 for s in seqs)  # planner + sub-agent sequences (the toy planner calls crop_video)
    else:
        assert seqs == [8, 8]  # planner sequences only: 2 prompts x G=4
    assert Path(summary["final_model"], "model.safetensors").is_file()
    assert Path(summary["final_model"], "agent_config.yaml").is_file()
    png = plot(str(tmp_path / "run"))
    assert png.stat().st_size > 10_000


@pytest.mark.dtype
def test_resume_is_exact(toy_policy_dir, toy_rl, tmp_path, on_cpu, dtype):
    bf16 = "true" if dtype == "bfloat16" else "false"  # bit-exact under bf16 autocast too (on the CPU)
    full = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "a", steps=2, bf16=bf16), progress=False)
    full.run()
    w_full = _weights(full.model)
    first = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "b", steps=2, save_every=5, bf16=bf16),
                        progress=False)
    first.setup()
    step = first.train_step

    def step_then_sigterm(*a, **kw):  # SIGTERM after the first update: the run saves it and ends
        out = step(*a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    first.train_step = step_then_sigterm
    assert first.run()["stopped"] == "SIGTERM" and first.step == 1 and not (tmp_path / "b" / "final").exists()
    assert (tmp_path / "b" / "checkpoint-1" / "trainer_state.json").is_file()
    # a line from an update that never reached its checkpoint must not survive the restart
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "reward": 123.0}) + "\n")
    resumed = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "b", steps=2, bf16=bf16), progress=False)
    resumed.run()
    assert resumed.step == 2
    for k, v in _weights(resumed.model).items():
        torch.testing.assert_close(v, w_full[k], rtol=0, atol=1e-6)
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert [r["prompts"] for r in a] == [r["prompts"] for r in b]


def test_replay_and_tas_run(toy_policy_dir, toy_rl, tmp_path):
    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "r", steps=2, tas_lambda=0.3,
               replay={"enabled": True, "per_step": 3, "capacity": 50})
    tr = GRPOTrainer(cfg, progress=False)
    tr.run()
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["replayed"] == 0 and recs[1]["replayed"] == 3  # rollouts; the buffer fills after the first step
    assert len(tr.replay) > 0
    # the checkpoint keeps frame keys; the frames themselves are stored once, shared by the checkpoints
    frames = list((tmp_path / "r" / "replay_frames").glob("*.npy"))
    assert frames and all(f.stat().st_size < 10_000 for f in frames)
    resumed = GRPOTrainer(cfg, progress=False)
    resumed.setup()
    a = [[s.input_ids for s in it.sequences] for it in tr.replay.items]
    b = [[s.input_ids for s in it.sequences] for it in resumed.replay.items]
    assert a == b and resumed.replay.baseline(tr.replay.items[0].prompt_id) == tr.replay.baseline(
        tr.replay.items[0].prompt_id)
    import numpy as np

    for x, y in zip(tr.replay.items, resumed.replay.items, strict=True):
        for s1, s2 in zip(x.sequences, y.sequences, strict=True):
            assert all(np.array_equal(i1, i2) for i1, i2 in zip(s1.images, s2.images, strict=True))


def test_fsdp2_on_two_hosts_updates_like_one_process(toy_policy_dir, toy_rl, tmp_path, on_cpu, host_bed):
    """The actor under torchrun + FSDP2 across two hosts (a node each, gloo over their network; uneven shares of
    real rollouts) takes the same step as one process on all of them: global loss normalisation, matched
    collectives."""
    import os
    import pickle

    import yaml

    from paravt_train.rl.objective import group_advantages

    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "one", micro_batch_size=1, lr=1e-3, prompts_per_step=2)
    tr = GRPOTrainer(cfg, progress=False)
    tr.setup()
    groups = tr.rollout(tr.prompts_for(0, prompts_from_rl(toy_rl["data"], toy_rl["video_root"])))
    eps = [e for g in groups for e in g]
    adv = group_advantages(torch.tensor([e.reward.total for e in eps]), cfg.group_size)
    adv = adv + torch.linspace(-0.5, 0.5, len(adv))  # a gradient even if a group's rewards tie
    items = [UpdateItem(sequence=s, advantage=float(a)) for e, a in zip(eps, adv.tolist(),
                                                                        strict=True) for s in e.sequences][:5]
    assert len(items) == 5  # ranks get 3 and 2: the short rank pads with a zero-weight pass
    path = tmp_path / "items.pkl"
    path.write_bytes(pickle.dumps(items))
    one = GRPOTrainer(cfg, progress=False)
    one.setup()
    one_stats = one.policy_update(items)
    want = {k: v.detach().clone() for k, v in one.model.state_dict().items()}
    two_cfg = cfg.model_copy(update={"backend": "sglang", "endpoint": "http://127.0.0.1:9",
                                     "output_dir": str(tmp_path / "two")}).model_dump(mode="json")
    cfg_path = tmp_path / "two.yaml"
    cfg_path.write_text(yaml.safe_dump(two_cfg))
    from tests.hosts import torchrun

    bed = host_bed(["node0", "node1"])
    worker = Path(__file__).with_name("rl_dist_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on the CPU, as `on_cpu`
    runs = torchrun([bed["node0"], bed["node1"]], [str(worker), str(cfg_path), str(path), str(tmp_path / "two.pt")],
                    env, timeout=300)
    assert [r.returncode for r in runs] == [0, 0], [r.stdout[-3000:] for r in runs]
    got = torch.load(tmp_path / "two.pt", weights_only=False)
    assert got["stats"]["sequences"] == 5 and got["stats"]["trained_tokens"] == one_stats["trained_tokens"]
    assert got["stats"]["grad_norm"] == pytest.approx(one_stats["grad_norm"], rel=1e-4)  # the same gradient
    moved = max(float((want[k] - v).abs().max()) for k, v in tr.model.state_dict().items())
    assert moved > 1e-4  # the step really changed the weights
    diff = max(float((want[k] - got["state"][k]).abs().max()) for k in want)
    assert diff < 2e-5


# --------------------------------------------------------------------------- SGLang weight sync


def _fixed_ids() -> list[int]:
    return [int(x) for x in torch.randint(10, 300, (24,), generator=torch.Generator().manual_seed(5))]


def _trainer_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_sglang_disk_sync_names_its_version(toy_policy_dir, toy_rl, tmp_path, sglang_toy):
    """weight_sync: disk against SGLang itself (0.5.23 on CPU): a fresh run pushes its starting weights (version
    "0"); after a sync the server scores exactly as the trained model and its replies carry the step as their
    weight_version; a refused load still resumes generation. SGLang cannot read Qwen3-VL's weights back
    (/get_weights_by_name: HTTP 400), so the checks compare logprobs."""

    stub = sglang_toy
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "s", backend="sglang", endpoint=stub.url),
                     progress=False)
    tr.setup()
    assert isinstance(tr.syncer, SGLangWeightSync)
    assert stub.get("/model_info").json()["weight_version"] == "0"
    assert __import__("httpx").post(stub.url + "/get_weights_by_name", json={"name": "lm_head.weight"},
                                    timeout=60).status_code == 400
    with torch.no_grad():
        next(iter(tr.model.parameters())).add_(0.5)  # weights the server does not have yet
    tr.step = 3
    tr.push_weights()
    ids = _fixed_ids()
    assert _server_logprobs(stub, ids) == pytest.approx(_trainer_logprobs(tr.model, ids), abs=1e-4)
    reply = stub.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert reply["meta_info"]["weight_version"] == "3"
    # a directory the server cannot load is refused (HTTP 400) and generation resumes. (A checkpoint whose tensor
    # shapes differ from the model's is worse: SGLang 0.5.23's scheduler asserts and the whole server exits.)
    broken = tmp_path / "missing"
    with pytest.raises(PolicyError, match="refused"):
        SGLangWeightSync(stub.url, tmp_path).serve(broken, version="4")
    reply = stub.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})  # not left paused
    assert reply["meta_info"]["weight_version"] == "3"
    with pytest.raises(PolicyError, match="weight sync"):
        SGLangWeightSync("http://127.0.0.1:9", tmp_path).serve(broken)


def test_sglang_tensor_sync_runs_in_a_weight_update_session(toy_policy_dir, toy_rl, tmp_path, sglang_toy):
    """weight_sync: tensor against SGLang itself (0.5.23 on CPU). SGLang 0.5.21+ refuses a tensor update outside a
    /begin_weight_update … /end_weight_update session (every push of the old client got HTTP 400); the sync
    opens one inside the pause and the server then holds the trained weights, named by the step. CPU tensors go
    by value (a plain pickle SGLang's safe unpickler loads): with torch's default file-descriptor sharing the
    scheduler, not a child of the trainer, failed the fd hand-over's authentication and the whole server died."""
    import pickle

    stub = sglang_toy
    import base64

    from paravt_train.sync.streamed import serialize_named_tensors

    one = serialize_named_tensors([("x", torch.arange(4.0)[1:3])])
    outside = __import__("httpx").post(stub.url + "/update_weights_from_tensor",
                                       json={"serialized_named_tensors": [one]})
    assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
    [(name, t)] = pickle.loads(base64.b64decode(one))  # by value: no handle, no authkey, no shared memory
    assert name == "x" and t.tolist() == [1.0, 2.0] and t.untyped_storage().nbytes() == 8  # the view's bytes only
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "t", backend="sglang", endpoint=stub.url,
                          sync={"via": "tensor", "tp_size": 2}), progress=False)
    tr.setup()
    assert isinstance(tr.syncer, SGLangTensorSync)
    tr.syncer.bucket_bytes = 1 << 20  # several buckets for a 5 MB model
    with torch.no_grad():
        next(iter(tr.model.parameters())).add_(0.25)
    tr.step = 2
    result = tr.push_weights()
    assert result["tensors"] == len(tr.model.state_dict()) and result["buckets"] > 1
    ids = _fixed_ids()
    assert _server_logprobs(stub, ids) == pytest.approx(_trainer_logprobs(tr.model, ids), abs=1e-4)
    assert stub.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})[
        "meta_info"]["weight_version"] == "2"
    assert stub.alive()


def test_distributed_sync_to_a_server_on_another_node(toy_policy_dir, toy_rl, tmp_path, sglang_toy):
    """weight_sync: distributed (verl / AReaL / slime's way to a server without a shared disk) against SGLang
    itself: the trainer's rank 0 and the server form a process group once (/init_weights_update_group, a TCP
    rendezvous), then every sync announces each bucket (/update_weights_from_distributed) and broadcasts its
    tensors over it — gloo on CPU here, NCCL on GPUs — inside a weight-update session. A push the server refuses
    leaves the group on both sides (/destroy_weights_update_group), so the next push joins again and lands; a
    trainer that restarts (a new process, the server still holding the old group under the same name) joins too:
    a join destroys the server's old group first (before, the server refused the name and the trainer waited in
    the rendezvous until its timeout)."""
    from paravt_train.sync.distributed import SGLangDistributedSync
    from tests.conftest import rendezvous_port

    stub = sglang_toy
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "d", backend="sglang", endpoint=stub.url,
                          sync={"via": "distributed", "group_backend": "gloo", "master_port": rendezvous_port(),
                                "bucket_mb": 1}), progress=False)
    tr.setup()  # joins the group and pushes the starting weights as version "0"
    assert isinstance(tr.syncer, SGLangDistributedSync) and stub.get("/model_info").json()["weight_version"] == "0"
    ids = _fixed_ids()
    for step, delta in ((1, 0.25), (2, -0.1)):  # the group is made once and used again
        with torch.no_grad():
            next(iter(tr.model.parameters())).add_(delta)
        tr.step = step
        result = tr.push_weights()
        assert result["buckets"] > 1 and result["tensors"] == len(tr.model.state_dict())
        assert _server_logprobs(stub, ids) == pytest.approx(_trainer_logprobs(tr.model, ids), abs=1e-4)
        assert stub.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})[
            "meta_info"]["weight_version"] == str(step)
    # a push that fails half way (the trainer ran out of memory gathering a parameter, after the first buckets had
    # reached the server): both sides leave the group, and the server is not left paused or in a session
    sync = tr.syncer
    named = list(__import__("paravt_train.sync.streamed", fromlist=["x"]).stream_parameters(tr.model))

    def failing():
        yield from named[:4]
        raise RuntimeError("CUDA out of memory while gathering")

    with pytest.raises(RuntimeError, match="out of memory"):
        sync.send_tensors(failing, version="bad")
    assert sync.groups == {}  # left on this side ...
    gone = __import__("httpx").post(stub.url + "/destroy_weights_update_group",
                                    json={"group_name": "paravt_weight_sync"}, timeout=60)
    assert gone.status_code == 400 and "does not exist" in gone.text  # ... and on the server's
    assert stub.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})["output_ids"]
    with torch.no_grad():
        next(iter(tr.model.parameters())).add_(0.1)
    tr.step = 3
    assert tr.push_weights()["tensors"] == len(named)  # joined again
    assert _server_logprobs(stub, ids) == pytest.approx(_trainer_logprobs(tr.model, ids), abs=1e-4)
    # a trainer restart: the old process is gone (its side of the group with it), the server still holds the group
    # under that name; the new trainer (another master port) joins
    import torch.distributed as dist

    for group in sync.groups.values():
        dist.destroy_process_group(group)
    restarted = SGLangDistributedSync(stub.url, master_port=rendezvous_port(), backend="gloo", bucket_bytes=1 << 20,
                                      device="cpu", timeout=60)
    with torch.no_grad():
        next(iter(tr.model.parameters())).add_(-0.2)
    restarted.push(tr.model, version="4")
    assert _server_logprobs(stub, ids) == pytest.approx(_trainer_logprobs(tr.model, ids), abs=1e-4)
    assert stub.get("/model_info").json()["weight_version"] == "4"
    restarted.close()
    assert stub.alive()


def test_a_fresh_run_pushes_its_starting_weights(toy_policy_dir, toy_rl, tmp_path, sglang_toy):
    """A server an earlier run updated serves that run's last weights (and version). A fresh run pushes its
    starting weights before its first rollout, as version "0", so step 1 is rolled out by the policy it trains
    (before, its rollouts came from the other policy and were trained as on-policy)."""
    other = _perturbed_copy(toy_policy_dir, tmp_path / "other", scale=0.2)
    SGLangWeightSync(sglang_toy.url, tmp_path).serve(other, version="7")  # an earlier run's step 7
    ids = _fixed_ids()
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "fresh", backend="sglang", endpoint=sglang_toy.url,
                          sync={"via": "tensor"}), progress=False)
    assert _server_logprobs(sglang_toy, ids) != pytest.approx(_trainer_logprobs(
        __import__("transformers").AutoModelForImageTextToText.from_pretrained(toy_policy_dir), ids), abs=1e-3)
    tr.setup()
    assert sglang_toy.get("/model_info").json()["weight_version"] == "0"
    assert _server_logprobs(sglang_toy, ids) == pytest.approx(_trainer_logprobs(tr.model, ids), abs=1e-4)
    [group] = tr.rollout(prompts_from_rl(toy_rl["data"], toy_rl["video_root"])[:1])
    assert all(e.versions == [0] for e in group)


def test_tensor_sync_call_sequence(json_server, monkeypatch):
    """The order SGLang needs, one server at a time (a router's workers one after the other, so the router always
    has workers that are not paused): pause → begin session → buckets (each TP rank's copy serialised on its own;
    the cache flushed and the version named with the last) → end session → continue, then the next server. A
    server without the session routes (404, an older SGLang) is updated without; a refused bucket still ends
    the session and resumes generation."""
    import paravt_train.sync.streamed as streamed

    state = {"begin": 200, "refuse": False}
    log: list[tuple[str, str]] = []

    def worker(name):
        def reply(path, body):
            log.append((name, path))
            if path == "/begin_weight_update":
                return state["begin"], {"success": state["begin"] == 200, "message": "Success"}
            if path == "/update_weights_from_tensor" and state["refuse"]:
                return 400, {"success": False, "message": "Failed to update weights: shape mismatch"}
            return 200, {"success": True, "message": "ok", "status": "ok"}
        return reply

    a, b = json_server(worker("a")), json_server(worker("b"))
    router = json_server(lambda path, body: (200, {"workers": [{"id": "1", "url": a.url}, {"id": "2", "url": b.url}]})
                         if path == "/workers" else (404, {}))
    calls = []
    serialize = streamed.serialize_named_tensors
    monkeypatch.setattr(streamed, "serialize_named_tensors", lambda named: calls.append(named) or serialize(named))
    named = [(f"w{i}", torch.zeros(1 << 16)) for i in range(3)]  # 256 KB each
    sync = SGLangTensorSync(router.url, tp_size=2, bucket_bytes=200 << 10)  # one tensor a bucket
    result = sync.send_tensors(iter(named), version="9")  # a one-shot stream, read again for the second server
    assert (result["buckets"], result["servers"]) == (3, 2)
    # (/ready once paused: whether the server tells a pause, so that one ended by someone else is seen)
    one = ["/pause_generation", "/begin_weight_update", "/ready", *["/update_weights_from_tensor"] * 3,
           "/end_weight_update", "/continue_generation"]
    # every server asked its TP size first (GET /server_info), then one at a time: never both paused
    assert log == [("a", "/server_info"), ("b", "/server_info")] + [("a", p) for p in one] + [("b", p) for p in one]
    assert len(calls) == 2 * 3 * 2  # servers x buckets x TP ranks: every rank's copy serialised on its own
    tensors = [body for srv in (a, b) for m, p, body in srv.seen if p == "/update_weights_from_tensor"]
    assert [len(body["serialized_named_tensors"]) for body in tensors] == [2] * 6
    assert [body["flush_cache"] for body in tensors] == [False, False, True] * 2
    assert [body.get("weight_version") for body in tensors] == [None, None, "9"] * 2
    log.clear()
    state["begin"] = 404
    sync.send_tensors(named[:1])
    assert [p for s_, p in log if s_ == "a"] == ["/server_info", "/pause_generation", "/begin_weight_update", "/ready",
                                                  "/update_weights_from_tensor", "/continue_generation"]
    log.clear()
    SGLangTensorSync(a.url, bucket_bytes=200 << 10, pause_mode="in_place").send_tensors(named[:1])
    assert [p.split("?")[0] for _, p in log][-2:] == ["/continue_generation", "/flush_cache"]  # once idle
    flush = [(p, body) for m, p, body in a.seen if p.startswith("/flush_cache")][-1]
    assert "timeout=" in flush[0]  # SGLang waits for idle itself (0.5.22+)
    assert [body for m, p, body in a.seen if p == "/update_weights_from_tensor"][-1]["flush_cache"] is False
    log.clear()
    state.update(begin=200, refuse=True)
    with pytest.raises(PolicyError, match="shape mismatch"):
        sync.send_tensors(named)
    assert [p for _, p in log][-2:] == ["/end_weight_update", "/continue_generation"]
    assert {s_ for s_, p in log if p != "/server_info"} == {"a"}  # stopped before the next server was paused


# --------------------------------------------------------------------------- online learning


def test_online_learning_neither_loses_nor_repeats_feedback(toy_policy_dir, toy_rl, tmp_path):
    from paravt_train.online.learner import OnlineLearner

    store = TrajectoryStore(tmp_path / "traces.db")
    ids = []
    for w in toy_rl["worlds"]:
        for q in w.questions[:2]:  # mcq, oe
            t = Trace(video=w.video, question=q.question, options=q.options)
            store.add(t)
            ids.append((t.id, q))
    for tid, q in ids[:5]:
        store.feedback(tid, answer=q.answer)
    store.feedback(ids[5][0], thumbs=True)  # no reference answer: skipped, counted
    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "online", data=None)

    first = OnlineLearner(cfg, store.path, progress=False, log=lambda *_: None)
    assert first.run(max_steps=1, once=True) == 1  # 2 prompts trained, checkpointed

    class Crash(Exception):
        pass

    second = OnlineLearner(cfg, store.path, progress=False, log=lambda *_: None)
    second.trainer.setup()
    orig = second.trainer.save

    def crash(*_, **__):
        raise Crash  # the update ran but never reached its checkpoint

    second.trainer.save = crash
    with pytest.raises(Crash):
        second.run(max_steps=1, once=True)
    second.trainer.save = orig

    # more feedback arrives while the learner is down; then a SIGTERM after one update (saved on the stop)
    store.feedback(ids[6][0], answer=ids[6][1].answer)
    cfg5 = cfg.model_copy(update={"save_every": 5})
    third = OnlineLearner(cfg5, store.path, progress=False, log=lambda *_: None)
    third.trainer.setup()
    step = third.trainer.train_step

    def step_then_sigterm(*a, **kw):
        out = step(*a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    third.trainer.train_step = step_then_sigterm
    assert third.run(once=True) == 1 and third.stopped == "SIGTERM"
    fourth = OnlineLearner(cfg5, store.path, progress=False, log=lambda *_: None)
    fourth.run(once=True)
    st = fourth.state
    trained = st.trained
    assert sorted(trained) == sorted(set(trained))  # nothing twice
    assert len(trained) == 6 and st.queue == [] and st.skipped == 1  # nothing lost
    recs = [json.loads(x) for x in (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()]
    logged = [p for r in recs for p in r["prompts"]]
    assert sorted(logged) == sorted(trained)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))


# --------------------------------------------------------------------------- SGLang-API RL loop


def _server_logprobs(stub, ids: list[int]) -> list[float]:
    """The server's log-probabilities of a fixed text sequence (SGLang: max_new_tokens 0, logprob_start_len 0)."""
    out = stub.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                                  "return_logprob": True, "logprob_start_len": 0})
    return [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]


def _perturbed_copy(model_dir: str, out: Path, scale: float = 0.05) -> Path:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    sd = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    sd = {k: (v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v) for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _running(url: str) -> int:
    import httpx

    return httpx.get(url + "/v1/loads", timeout=30).json()["loads"][0]["num_running_reqs"]


def _used_tokens(url: str) -> int:
    """The server's KV cache in use, in tokens: it grows by one per token a running request generates."""
    import httpx

    return httpx.get(url + "/v1/loads", timeout=30).json()["loads"][0]["num_used_tokens"]


def test_weight_push_while_requests_are_in_flight(toy_policy_dir, tmp_path, sglang_toy):
    """Pushing weights to a server that is answering (the online learner's case), against SGLang itself, in every
    pause mode. retract (the default, with a flush): in-flight requests go back to the queue keeping their tokens
    and continue on the new weights — each reply says which tokens which version produced (weight_versions), and
    the tokens after the push are what the new weights generate from the kept ones. in_place keeps them running
    and the update must not flush: the cache is flushed by ``/flush_cache?timeout=`` once they finish (SGLang
    waits for idle itself), and a server still busy when that times out keeps the old prefixes, which the sync
    says. in_place + flush is refused with HTTP 400 — after the weights were swapped (0.5.22+). abort ends them:
    HTTP 200 with finish reason abort and the tokens so far (the backend retries such replies)."""
    import threading as th
    import time

    import httpx

    from paravt_train.sync.http import flush_when_idle

    stub = sglang_toy
    new = _perturbed_copy(toy_policy_dir, tmp_path / "new")
    ids = _fixed_ids()[:12]
    n = 1200
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True}

    def in_flight(k=3):
        results = []
        threads = [th.Thread(target=lambda: results.append(stub.post("/generate", body))) for _ in range(k)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while _running(stub.url) < k:
            assert time.time() < deadline, "the requests did not start"
            time.sleep(0.02)
        time.sleep(0.3)  # some tokens in
        return threads, results

    def spans(r):
        meta = r["meta_info"]
        return [(s["version"], s["start"], s["end"]) for s in meta.get("weight_versions") or []] or [
            (meta["weight_version"], 0, len(r["output_ids"]))]

    threads, results = in_flight()
    SGLangWeightSync(stub.url, tmp_path, pause_mode="retract").serve(new, version="1")
    for t in threads:
        t.join(300)
    assert stub.alive() and len(results) == 3
    split = [r for r in results if len(spans(r)) == 2]
    assert split, [spans(r) for r in results]  # the requests running at the push span both versions
    for r in results:
        assert r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == n
        assert [v for v, *_ in spans(r)] in (["default"], ["1"], ["default", "1"])
        assert r["meta_info"]["weight_version"] == spans(r)[-1][0]
    for r in split:  # kept tokens, then the new weights' continuation of them
        (_, _, k), _ = spans(r)
        assert 0 < k < n and r["meta_info"]["num_retractions"] >= 1
        rest = stub.post("/generate", {"input_ids": ids + r["output_ids"][:k], "sampling_params": {
            "max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}})
        assert rest["output_ids"] == r["output_ids"][k:k + 64] and rest["meta_info"]["weight_version"] == "1"
    fresh = stub.post("/generate", body)
    assert any(r["output_ids"] != fresh["output_ids"] for r in split)  # not a restart from scratch

    # in_place: the requests keep running through the update; the sync's flush waits until they are done
    threads, results = in_flight()
    logged: list[str] = []
    # held in place (the sync's own pause, early), the requests keep the server busy longer than the flush's
    # timeout whatever the machine's speed: said (the sync below continues them)
    httpx.post(stub.url + "/pause_generation", json={"mode": "in_place"}, timeout=60).raise_for_status()
    with httpx.Client(timeout=120) as c:
        assert not flush_when_idle(c, stub.url, timeout=1, log=logged.append)
    assert "keeps prefixes computed with the old weights" in logged[0]
    SGLangWeightSync(stub.url, tmp_path, pause_mode="in_place").serve(toy_policy_dir, version="2")
    assert _running(stub.url) == 0  # it returned once they were done and the cache was flushed
    for t in threads:
        t.join(300)
    assert len(results) == 3 and all(len(r["output_ids"]) == n for r in results)
    assert all([v for v, *_ in spans(r)] == ["1", "2"] for r in results)  # held in place, then the new weights

    # in_place + a flush with the update: refused, after the weights were swapped
    threads, results = in_flight()
    httpx.post(stub.url + "/pause_generation", json={"mode": "in_place"})
    refused = httpx.post(stub.url + "/update_weights_from_disk", json={"model_path": str(new), "flush_cache": True,
                                                                       "weight_version": "3"})
    assert refused.status_code == 400 and "not flushed" in refused.json()["message"]
    assert httpx.post(stub.url + "/flush_cache").status_code == 400
    httpx.post(stub.url + "/continue_generation", json={})
    for t in threads:
        t.join(300)
    assert stub.alive() and len(results) == 3  # nothing died
    assert all(spans(r)[-1][0] == "3" for r in results)  # the weights did change
    assert httpx.post(stub.url + "/flush_cache").status_code == 200  # idle: the flush goes through

    # abort: the requests end at the pause, HTTP 200, finish reason abort, their tokens so far
    threads, results = in_flight()
    SGLangWeightSync(stub.url, tmp_path, pause_mode="abort").serve(toy_policy_dir, version="4")
    for t in threads:
        t.join(300)
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 3
    assert all(0 < len(r["output_ids"]) < n for r in results)
    assert stub.post("/generate", body)["meta_info"]["weight_version"] == "4"


# --------------------------------------------------------------------------- failure hygiene, DAPO, evaluation


def test_tensor_sync_tags_cuda_devices_by_uuid():
    """SGLang's server maps a device UUID at position 6 of a CUDA tensor's reduction back to its own device
    ordinal: the trainer and the server may see the GPUs in different orders."""
    from paravt_train.sync.streamed import tag_device_uuid

    fn = object()
    args = ("cls", (4,), (1,), 0, "dtype", False, 3, "handle", 64, 0)
    tagged_fn, tagged = tag_device_uuid((fn, args), uuid_of=lambda index: f"GPU-uuid-of-{index}")
    assert tagged_fn is fn and tagged[6] == "GPU-uuid-of-3" and tagged[:6] == args[:6] and tagged[7:] == args[7:]


def test_failed_episodes_are_counted_and_dropped_or_kept(toy_policy_dir, toy_rl, tmp_path):
    from paravt_agent.agent import Agent
    from paravt_agent.policy.base import Policy, text_of
    from paravt_train.rl.rollout import PromptCache

    class FailsAfterTools(Policy):
        """The wrapped policy, but a planner turn that follows a tool response raises on odd seeds."""

        name = "local"
        returns_tokens = True

        def __init__(self, inner):
            self.inner = inner

        async def generate(self, messages, sampling, prefix="", continuation=None):
            if "<tool_response>" in text_of(messages[-1]["content"]) and (sampling.seed or 0) % 2:
                raise RuntimeError("the endpoint fell over mid-episode")
            return await self.inner.generate(messages, sampling, prefix, continuation)

    for policy in ("drop", "keep"):
        tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / policy, group_size=4, failed_episodes=policy,
                              gating=False), progress=False)
        tr.setup()
        tr.agent = Agent(policy=FailsAfterTools(tr.agent.policy), config=tr.agent.config)
        tr.cache = PromptCache(tr.agent)
        prompts = [p for p in prompts_from_rl(toy_rl["data"], toy_rl["video_root"]) if p.task == "mcq"][:2]
        rec = tr.train_step(prompts)
        assert rec["failed_episodes"] > 0  # counted in metrics.jsonl
        groups = tr.rollout(prompts, salt=7)
        failed = [e for g in groups for e in g if e.failed]
        assert failed and all("fell over" in e.failed for e in failed)
        trained = [e for g in groups for e in tr.advantages(g)]
        assert all(e.failed is None for e in trained) == (policy == "drop")


def test_an_episode_whose_tool_slot_the_runtime_lost_is_failed_not_scored(toy_policy_dir, toy_rl, tmp_path):
    """A sub-agent call that fails for the infrastructure's reasons (the endpoint down after its retries) leaves
    an error slot; the planner still answers (the graph routes on), but the episode is counted as failed: an
    outage must not be scored as the policy's doing (it would teach the policy to stop calling tools)."""
    from paravt_agent.agent import Agent
    from paravt_agent.errors import PolicyError
    from paravt_agent.policy.base import Policy
    from paravt_train.rl.rollout import PromptCache

    class SubAgentsDown(Policy):
        name = "local"
        returns_tokens = True

        def __init__(self, inner):
            self.inner = inner

        async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
            if role == "subagent" and (sampling.seed or 0) % 2:
                raise PolicyError("503 from the rollout server")
            return await self.inner.generate(messages, sampling, prefix, continuation, role=role)

    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "down", group_size=6, gating=False), progress=False)
    tr.setup()
    tr.agent = Agent(policy=SubAgentsDown(tr.agent.policy), config=tr.agent.config.model_copy(update={"retries": 0}))
    tr.cache = PromptCache(tr.agent)
    prompts = [p for p in prompts_from_rl(toy_rl["data"], toy_rl["video_root"]) if p.task == "mcq"][:2]
    eps = [e for g in tr.rollout(prompts) for e in g]
    lost = [e for e in eps if any(c.runtime_error for t in e.answer.trace.turns for c in t.calls)]
    assert lost and len(lost) < len(eps)
    for e in eps:
        assert (e in lost) == (e.failed is not None), e.failed
    for e in lost:
        assert "503 from the rollout server" in e.failed and e.answer.trace.turns[-1].calls == []  # it answered
    assert all(e.failed is None for g in tr.rollout(prompts) for e in tr.advantages(g))  # dropped from training


def test_the_clip_acts_with_several_optimizer_steps_per_batch(toy_policy_dir, toy_rl, tmp_path):
    """One optimizer step per batch keeps the ratio at 1: PPO's clip (and DAPO's clip-higher) never act. With
    ppo_epochs or mini_batches > 1 the later steps see a moved policy and the clip takes hold."""
    prompts = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])[:2]
    fractions = {}
    for name, kw in {"one": {}, "mini": {"mini_batches": 2}, "epochs": {"ppo_epochs": 2}}.items():
        tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / name, lr=2e-2, micro_batch_size=1, gating=False,
                              **kw), progress=False)
        tr.setup()
        groups = tr.rollout(prompts)
        # the toy policy is near-certain of its tokens (a ratio above 1 + ε needs p < 0.83): push them down
        items = [UpdateItem(sequence=s, advantage=-1.0) for g in groups for e in g for s in e.sequences]
        fractions[name] = tr.policy_update(items)["clip_fraction"]
    assert fractions["one"] == 0.0 and fractions["mini"] > 0 and fractions["epochs"] > 0, fractions


def test_unreadable_videos_fail_their_group_and_the_step_goes_on(toy_policy_dir, toy_rl, tmp_path):
    """One unreadable video in the RL data: its group fails (counted, the path named), the others train, and the
    model-behaviour metrics (f_τ, κ, closure, reward) come from the episodes that ran. Episode ids name their
    step, rank and sampling round, so they never collide across steps (the update groups tokens by episode)."""
    import dataclasses

    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 100)
    logged = []
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "bad", group_size=2, gating=False), progress=False,
                     log=logged.append)
    tr.setup()
    good = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])[0]
    broken = dataclasses.replace(good, id="broken", video=str(bad))
    rec = tr.train_step([good, broken])
    assert rec["episodes"] == 4 and rec["failed_episodes"] == 2 and rec["sequences"] > 0
    assert "unreadable video" in rec["failures"][0] and str(bad) in rec["failures"][0]
    assert any(str(bad) in line for line in logged)
    assert rec["kappa"] >= 1.0  # the episodes that ran called tools; the failed ones are not counted as 0
    first = {e.id for g in tr.rollout([good]) for e in g}
    tr.step += 1
    again = {e.id for g in tr.rollout([good]) for e in g} | {e.id for g in tr.rollout([good], salt=1) for e in g}
    assert not first & again and len(again) == 4


def test_synchronous_loop_is_the_eta_zero_case(toy_policy_dir, toy_rl, tmp_path, on_cpu):
    """max_staleness 0 is the synchronous loop, number for number: run() equals train_step after train_step,
    and none of the asynchronous machinery (producer, behaviour weights) takes part."""
    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "run", steps=2, gating=False, rollout_batch=1)  # batch-exact
    ran = GRPOTrainer(cfg, progress=False, log=lambda *_: None)
    ran.run()
    step = GRPOTrainer(cfg.model_copy(update={"output_dir": str(tmp_path / "steps")}), progress=False)
    step.setup()
    prompts = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])
    for k in range(2):
        step.train_step(step.prompts_for(k, prompts), pool=prompts)
    a = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "steps" / "metrics.jsonl").read_text().splitlines()]
    drop = ("rollout_seconds", "update_seconds", "sync_seconds", "time")
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b]
    assert ran.producer is None and "behaviour_weight" not in a[0]
    for k, v in ran.model.state_dict().items():
        assert torch.equal(v, step.model.state_dict()[k]), k


def test_a_push_mid_episode_trains_each_token_with_its_own_behaviour(tiny_model, toy_rl, tmp_path, own_sglang):
    """Asynchronous RL: a weight push lands while an episode is being generated (retract: the request keeps
    its tokens and continues on the new weights). The episode records both versions, the tokens before the push
    were sampled by the old version, and the decoupled update weighs each token by π_prox / π_behav with the
    logprob the server reported for it. Against SGLang itself: it reports the version spans, and its logprobs are
    what the weights are computed from."""
    import threading
    import time


    [stub] = own_sglang(tiny_model)  # random weights: long answers, time for a push mid-generation
    tr = GRPOTrainer(_cfg(tiny_model, toy_rl, tmp_path / "async", backend="sglang", endpoint=stub.url, group_size=2,
                          max_new_tokens=3000, gating=False, max_staleness=1, lr=1e-3, temperature=0.05),
                     progress=False)  # nearly greedy: the random model repeats one token, never a vision placeholder
    tr.setup()
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the next version differs from the served one
    prompt = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])[:1]
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("groups", tr.rollout(prompt)))
    thread.start()
    deadline = time.time() + 120
    while _running(stub.url) < 2:  # both rollouts of the group are generating
        assert time.time() < deadline, "no generation started"
        time.sleep(0.05)
    base = _used_tokens(stub.url)
    while _used_tokens(stub.url) < base + 2 * 400:  # some hundred tokens in, whatever the machine's speed
        assert time.time() < deadline, "the rollouts did not generate"
        time.sleep(0.05)
    tr.step = 1
    tr.push_weights()  # version "1" reaches the server while the group is generating
    thread.join(300)
    eps = out["groups"][0]
    split = [e for e in eps if e.versions == [0, 1] and not e.failed]
    assert split, [(e.versions, e.failed) for e in eps]
    e = split[0]
    rec = next(r for r in e.answer.records if r.generation.weight_versions)
    (_, _, k), (v, start, end) = rec.generation.weight_versions
    assert v == "1" and start == k and 0 < k < end
    from paravt_train.rl.update import UpdateItem as Item

    planner = [Item(sequence=s, advantage=1.0) for s in e.sequences if s.role == "planner"][:1]
    mb = tr.policy_update._prepare(planner, False)
    # which version sampled each token, from the logprobs the server recorded: closer to version 0's before the
    # push, to version 1's after it (SGLang-vs-transformers differences are tiny next to the versions' own)
    from transformers import AutoModelForImageTextToText

    from paravt_train.rl.scoring import token_logprobs

    v0 = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        lp0, _ = token_logprobs(v0, mb.tensors, tr.cfg.temperature)
        lp1, _ = token_logprobs(tr.model, mb.tensors, tr.cfg.temperature)
    m = mb.mask[0] > 0
    behaviour = mb.tensors["behaviour_logp"][0, 1:][m]
    d0, d1 = (behaviour - lp0[0][m]).abs(), (behaviour - lp1[0][m]).abs()
    # judged on the tokens the two versions score apart (the random model repeats a token both are nearly sure of,
    # and there the versions differ by less than SGLang and transformers do at τ 0.05)
    apart = ((lp0[0][m] - lp1[0][m]).abs() > 1e-3)[:k]
    assert apart.sum() >= 3
    assert float((d0[:k][apart] < d1[:k][apart]).float().mean()) > 0.5  # sampled by version 0
    # After the push SGLang continues the retracted request from its radix cache: the update refused to flush it
    # (a request was queued), so the prefix's KV is the old weights' and the tokens after the push mix the two
    # versions (measured: only 10-20% of them closer to version 1). The update does not assume either: each token's
    # behaviour is the logprob the server reported for it, and its weight π_prox / π_behav is computed from that.
    w = mb.token_weights[0][m]
    expected = torch.exp(lp1[0][m] - behaviour)
    inside = (expected > 0.2) & (expected < 5)  # the paper config's cap
    assert inside.sum() > 0 and torch.allclose(w[inside], expected[inside], rtol=1e-3, atol=1e-4)
    n0 = len(rec.generation.prompt_ids) + len(rec.generation.prefix_ids or [])
    assert n0 > 0


def test_asynchronous_loop_rolls_out_ahead_within_the_staleness_bound(toy_policy_dir, toy_rl, tmp_path,
                                                                     sglang_toy):
    """η = 1 against SGLang itself: the producer rolls out step k + 1 while step k trains (their phases overlap),
    no update trains tokens more than one version old, the decoupled objective's statistics are logged, and the
    run ends with the server holding the trained weights."""
    stub = sglang_toy
    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "eta1", backend="sglang", endpoint=stub.url, steps=2,
               gating=False, max_staleness=1, group_size=2, save_every=10)
    tr = GRPOTrainer(cfg, progress=False, log=lambda *_: None)
    tr.run()
    recs = [json.loads(x) for x in (tmp_path / "eta1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert max(int(g) for g in r["staleness_hist"]) <= 1 and r["dropped_stale"] == 0
        assert "behaviour_weight" in r and 0.0 <= r["capped_tokens"] <= 1.0
    assert recs[0]["staleness"] == 0  # the first step's rollouts started on the initial weights
    tl = tr.producer.timeline
    rollouts = {p["step"]: p for p in tl if p["name"] == "rollout"}
    updates = {p["step"]: p for p in tl if p["name"] == "update+sync"}
    assert rollouts[2]["start"] < updates[1]["end"]  # step 2 rolled out while step 1 trained
    info = __import__("httpx").get(stub.url + "/model_info").json()
    assert info["weight_version"] == "2"


def test_dapo_dynamic_sampling_refills_zero_variance_groups(toy_policy_dir, toy_rl, tmp_path):
    import copy

    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "dapo", method="dapo", group_size=2, gating=False),
                     progress=False)
    tr.setup()
    assert (tr.cfg.aggregation, tr.cfg.clip_high, tr.ref) == ("token-mean", 0.28, None)  # DAPO: no reference
    prompts = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])
    real = tr.rollout(prompts[:1])[0]
    calls = []

    def fake_rollout(ps, salt=0):
        calls.append(len(ps))
        groups = []
        for k, _ in enumerate(ps):
            g = copy.deepcopy(real)
            flat = salt == 0 and k == 0  # the first group of the step has no reward spread
            for i, e in enumerate(g):
                e.reward.total = 1.0 if flat else float(i)
                e.prompt_id = f"{salt}-{k}"
                for s in e.sequences:
                    s.episode = f"{salt}-{k}#{i}"
            groups.append(g)
        return groups

    tr.rollout = fake_rollout
    rec = tr.train_step(prompts[:2], pool=prompts)
    assert calls == [2, 1]  # the zero-variance group was replaced by one more prompt's group
    assert rec["groups"] == 3 and rec["zero_std_groups"] == 1
    assert rec["sequences"] == 2 * sum(len(e.sequences) for e in real)  # two informative groups trained


def test_heldout_evaluation_is_paravt_train_eval(toy_policy_dir, toy_rl, tmp_path):
    """RL's held-out numbers are `paravt-train eval`'s on the model it saves: the same agent config (the model's,
    greedy, the 64-frame protocol, and the token budgets RL trained with — not the base's), the same scorer."""
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig, resolve_agent_config
    from paravt_train.benchmarks import load_benchmark
    from paravt_train.eval import run_eval

    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "ev", max_new_tokens=80, subagent_max_new_tokens=30),
                     progress=False)
    tr.setup()
    saved = AgentConfig.for_model(str(tr.save_model(tmp_path / "exported")))
    base = AgentConfig.for_model(toy_policy_dir)
    assert (saved.planner_sampling.max_new_tokens, saved.subagent_sampling.max_new_tokens) == (80, 30)
    assert base.planner_sampling.max_new_tokens != 80  # the trained budgets, not the base's
    held = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])[:4]
    got = tr.evaluate(held)
    items = load_benchmark("toy", Path(toy_rl["data"]), check_videos=True)[:4]
    agent = Agent(model=str(tmp_path / "exported"),
                  config=resolve_agent_config(None, str(tmp_path / "exported"), ["mode=parallel"]))
    recs = run_eval(agent, items, tmp_path / "eval.jsonl", progress=False)
    want = [r.get("correct", r.get("iou", r.get("f1"))) for r in recs]
    assert got["eval/scores"] == pytest.approx(want) and got["eval/n"] == 4
    assert tr.eval_agent_config().frames == resolve_agent_config(None, toy_policy_dir).frames


def test_llm_judge_from_the_grpo_config(toy_policy_dir, toy_rl, tmp_path, json_server):
    srv = json_server(lambda path, body: (200, {
        "id": "j", "object": "chat.completion", "created": 0, "model": "judge",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "0.25"}}]}))
    judge = {"endpoint": srv.url + "/v1", "model": "judge"}
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path / "j", reward={"judge": judge}, gating=False),
                     progress=False)
    tr.setup()
    oe = [p for p in prompts_from_rl(toy_rl["data"], toy_rl["video_root"]) if p.task == "oe"][:1]
    [group] = tr.rollout(oe)
    assert all(e.reward.acc == 0.25 for e in group)  # the judge's verdict, scored off the event loop
