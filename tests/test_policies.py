"""Policy backends end to end: the tiny Qwen3-VL model in process, behind `transformers serve`,
and the SGLang /generate client against a local server answering with recorded payloads."""

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError, PolicyError
from paravt_agent.policy.base import Sampling
from paravt_agent.policy.chat import BANNED_LOGIT, ban
from paravt_agent.policy.local import LocalPolicy
from paravt_agent.policy.sglang_backend import SGLangPolicy
from paravt_agent.prompts import planner_messages
from tests.conftest import assert_same_tokens, free_port

SHORT = AgentConfig(planner_sampling=Sampling(max_new_tokens=24), subagent_sampling=Sampling(max_new_tokens=12))



@pytest.fixture(scope="module")
def local(tiny_model, device, dtype):
    return LocalPolicy(tiny_model, device=device, dtype=dtype)


def overview_messages(media, n=4):
    from paravt_agent.video import VideoReader

    clip = VideoReader(media["video"]).overview(n=n)
    return planner_messages("You are a video understanding agent.", clip.frames, clip.timestamps, 40.0, "Which colour?")


@pytest.mark.dtype
def test_local_generation_is_token_in_token_out(local, media, tiny_model, numeric_bound, record_property):
    msgs = overview_messages(media)
    gen = local.generate_sync(msgs, Sampling(max_new_tokens=16), prefix="<think>\n")
    tok = local.processor.tokenizer
    assert gen.text.startswith("<think>\n")
    assert gen.prefix_ids == tok("<think>\n", add_special_tokens=False)["input_ids"]
    assert len(gen.output_ids) == len(gen.logprobs) == gen.completion_tokens <= 16
    assert all(lp <= 0 for lp in gen.logprobs)
    body = gen.output_ids[:-1] if gen.finish_reason == "stop" else gen.output_ids
    assert gen.text == "<think>\n" + tok.decode(body, skip_special_tokens=False)
    # the prompt holds the expanded image tokens of 4 frames
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert gen.prompt_ids.count(image_id) > 0 and gen.prompt_tokens == len(gen.prompt_ids) + len(gen.prefix_ids)
    # greedy logprobs are the model's own: re-scoring the sequence gives the same numbers
    import torch

    ids = torch.tensor([gen.prompt_ids + gen.prefix_ids + gen.output_ids])
    enc = local.encode(msgs, "<think>\n")
    assert enc.ids == gen.prompt_ids + gen.prefix_ids
    n_out = len(gen.output_ids)
    mm = local.chat.mm_token_types(ids)
    dev = local.model.device  # the device the backend picked
    with torch.no_grad():
        logits = local.model(input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev),
                             mm_token_type_ids=mm.to(dev), pixel_values=enc.pixel_values.to(dev),
                             image_grid_thw=torch.tensor(enc.image_grid_thw, device=dev)).logits
    # (with the vision placeholders banned, as the sampler bans them: the random model gives them ~0.5 %)
    lp = torch.log_softmax(ban(logits[0, -n_out - 1 : -1].float(), local.chat.placeholder_ids), -1)
    lp = lp.gather(1, ids[0, -n_out:, None].to(dev))[:, 0]
    bound = numeric_bound("rescore", tiny_model)  # the same tokens by construction: each logprob within its bound
    limits = [bound.at(x) for x in gen.logprobs]
    diffs = [abs(a - b) for a, b in zip(lp.tolist(), gen.logprobs, strict=True)]
    bound.check(record_property, max(diffs), max(limits))
    assert all(d <= b for d, b in zip(diffs, limits, strict=True)), (diffs, limits, bound.formula())


def test_local_sampling_seed_and_concurrency(local, media):
    msgs = overview_messages(media)
    s = Sampling(temperature=0.9, max_new_tokens=12, seed=7)
    a = local.generate_sync(msgs, s)
    b = local.generate_sync(msgs, s)
    assert a.output_ids == b.output_ids  # same seed, same sample

    async def many():
        return await asyncio.gather(*(local.generate(msgs, Sampling(max_new_tokens=10)) for _ in range(4)))

    outs = asyncio.run(many())
    assert len({tuple(o.output_ids) for o in outs}) == 1  # concurrent greedy calls agree


@pytest.mark.dtype
def test_local_batches_concurrent_calls_and_each_row_is_its_own(tiny_model, media, device, dtype, numeric_bound,
                                                                  record_property):
    """Concurrent calls run as one left-padded batch; every row equals the same request run alone
    (tokens and logprobs), greedy or sampled with its own seed; other limits wait for their own batch."""
    policy = LocalPolicy(tiny_model, max_batch=8, batch_wait=0.05, device=device, dtype=dtype)
    reqs = [(overview_messages(media, n), Sampling(max_new_tokens=14, temperature=t, seed=s), p)
            for n, t, s, p in [(2, 0.0, None, "<think>\n"), (4, 0.0, None, ""), (6, 1.0, 11, "<think>\n"),
                               (3, 1.0, 12, "")]]
    other = (overview_messages(media, 5), Sampling(max_new_tokens=6), "")

    async def together():
        return await asyncio.gather(*(policy.generate(*r) for r in [*reqs, other]))

    outs = asyncio.run(together())
    assert [o.batch_size for o in outs] == [4, 4, 4, 4, 1]
    bound = numeric_bound("batch", tiny_model)
    worst = held = 0.0
    for (msgs, s, p), got in zip(reqs + [other], outs, strict=True):
        alone = policy.generate_sync(msgs, s, p)
        assert alone.batch_size == 1
        assert got.prompt_ids == alone.prompt_ids and got.prefix_ids == alone.prefix_ids
        # float32: the same tokens and text, logprobs within 1e-4; bf16: the same up to a near-tie (conftest)
        d, h = assert_same_tokens(got.output_ids, got.logprobs, alone.output_ids, alone.logprobs, bound)
        worst, held = max(worst, d), max(held, h)
        assert got.text == alone.text or (dtype != "float32" and got.output_ids != alone.output_ids)
    bound.check(record_property, worst, held)
    assert outs[4].completion_tokens <= 6
    # the two seeded rows differ from greedy decoding of the same prompt (they really sampled)
    greedy = policy.generate_sync(reqs[2][0], Sampling(max_new_tokens=14), "<think>\n")
    assert greedy.output_ids != outs[2].output_ids


def test_local_batch_row_ended_by_stop_string_carries_no_padding(toy_policy_dir, media):
    """In a batch, a row that ends on a stop string while another row goes on is padded by ``generate``;
    the padding is not part of its output (same tokens, text and finish reason as the row run alone)."""
    from paravt_agent.prompts import subagent_messages
    from paravt_agent.video import VideoReader

    policy = LocalPolicy(toy_policy_dir, max_batch=2, batch_wait=0.05)
    video = VideoReader(media["video"])

    def sub(a, b):
        clip = video.crop(a, b, crop_max_frames=16, crop_fps=1.0, max_pixels=1024, factor=32)
        return subagent_messages(clip.frames, clip.timestamps, (a, b), "What colour is shown?")

    a_msgs, b_msgs = sub(8, 9), sub(10, 17)  # the sub-agent lists every second: B's list is longer
    a_free = policy.generate_sync(a_msgs, Sampling(max_new_tokens=16))
    b_free = policy.generate_sync(b_msgs, Sampling(max_new_tokens=16))
    tok = policy.processor.tokenizer
    # a stop string that row A reaches within its first tokens and row B never reaches
    stop = next(t for k in range(1, 8)
                if (t := tok.decode(a_free.output_ids[:k])) and t not in b_free.text)
    sampling = Sampling(max_new_tokens=16, stop=[stop])

    async def together():
        return await asyncio.gather(policy.generate(a_msgs, sampling), policy.generate(b_msgs, sampling))

    a, b = asyncio.run(together())
    assert a.batch_size == 2
    assert b.completion_tokens > a.completion_tokens  # B went on after A had stopped
    alone = policy.generate_sync(a_msgs, sampling)
    assert a.output_ids == alone.output_ids and a.text == alone.text and len(a.logprobs) == len(a.output_ids)
    assert a.finish_reason == alone.finish_reason == "stop"
    assert tok.pad_token_id not in a.output_ids


def test_local_batch_a_bad_request_fails_alone(tiny_model, media):
    policy = LocalPolicy(tiny_model, max_batch=4, batch_wait=0.05)
    bad = [{"role": "user", "content": [{"type": "image", "image": None, "timestamp": 0.0}]}]

    async def run():
        return await asyncio.gather(policy.generate(bad, Sampling(max_new_tokens=4)),
                                    policy.generate(overview_messages(media), Sampling(max_new_tokens=4)),
                                    return_exceptions=True)

    bad_out, good_out = asyncio.run(run())
    assert isinstance(bad_out, Exception) and good_out.completion_tokens > 0  # only the bad request fails
    # the batcher survives: the next call works
    ok = asyncio.run(policy.generate(overview_messages(media), Sampling(max_new_tokens=4)))
    assert ok.completion_tokens > 0


def _never_ending(policy: LocalPolicy) -> LocalPolicy:
    """The tiny model never samples its end of turn: every request runs to its max_new_tokens."""
    policy.chat.placeholder_ids.append(policy.eos_id)
    return policy


def test_local_cancelled_rows_leave_the_batch_and_free_it(tiny_model):
    """A caller cancelled mid-generation (a deadline, a client gone) stops its row at the next step; the other
    rows go on unchanged, and a batch whose rows are all cancelled ends at once so the next request runs."""
    policy = _never_ending(LocalPolicy(tiny_model, max_batch=2, batch_wait=5.0))
    msgs = [{"role": "user", "content": "red green blue"}]
    long, longer, short = Sampling(max_new_tokens=400), Sampling(max_new_tokens=2000), Sampling(max_new_tokens=4)
    t0 = time.perf_counter()
    alone = policy.generate_sync(msgs, long)
    per_token = (time.perf_counter() - t0) / alone.completion_tokens
    assert alone.completion_tokens == 400

    async def running():  # once the batcher has taken every request (none pending), a few tokens in
        while policy.batcher.waiting:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2 + 10 * per_token)

    async def one_cancelled():
        a = asyncio.ensure_future(policy.generate(msgs, long))
        b = asyncio.ensure_future(policy.generate(msgs, long))
        await asyncio.sleep(0.05)
        await running()
        a.cancel()
        return await b, a

    b, a = asyncio.run(one_cancelled())
    assert a.cancelled() and b.batch_size == 2 and b.output_ids == alone.output_ids  # B went on as if alone

    async def all_cancelled_then_next():
        a = asyncio.ensure_future(policy.generate(msgs, longer))
        await asyncio.sleep(0.05)
        await running()
        t_cancel = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(a, 0.0)
        nxt = await policy.generate(msgs, short)
        return nxt, time.perf_counter() - t_cancel

    policy.batcher.batch_wait = 0.05
    nxt, waited = asyncio.run(all_cancelled_then_next())
    assert nxt.completion_tokens == 4
    assert waited < 0.25 * 2000 * per_token, (waited, per_token)  # it did not wait out the cancelled generation


def test_local_long_prompt_is_batched_apart_and_short_ones_go_first(tiny_model):
    """One long prompt arriving first does not pad the short ones' batch or hold it: the short ones run as one
    batch ahead of it (for at most long_patience batches), the long one alone."""
    policy = LocalPolicy(tiny_model, max_batch=9, batch_wait=2.0, long_prompt_tokens=300)  # all 9 arrive in time
    sampling = Sampling(max_new_tokens=6)
    long_msgs = [{"role": "user", "content": "red green blue yellow " * 150}]
    n_long = policy.count_tokens(long_msgs)
    assert n_long > 300
    policy.batcher.max_batch_tokens = n_long + 100  # the long prompt fits, with no short one beside it
    shorts = [[{"role": "user", "content": f"question {i}: red or green?"}] for i in range(8)]
    done: list[str] = []

    async def timed(name, msgs):
        out = await policy.generate(msgs, sampling)
        done.append(name)
        return out

    async def run():
        first = asyncio.ensure_future(timed("long", long_msgs))
        await asyncio.sleep(0.01)
        rest = asyncio.gather(*(timed(f"s{i}", m) for i, m in enumerate(shorts)))
        return await first, await rest

    long_out, short_outs = asyncio.run(run())
    assert long_out.batch_size == 1 and [o.batch_size for o in short_outs] == [8] * 8
    assert done[-1] == "long"  # the short ones finished first
    # patience: a long prompt passed over long_patience times runs, even with short ones waiting
    policy.batcher.long_patience = 0

    async def run_impatient():
        first = asyncio.ensure_future(timed("long", long_msgs))
        await asyncio.sleep(0.01)
        return await asyncio.gather(first, *(timed(f"s{i}", m) for i, m in enumerate(shorts)))

    done.clear()
    outs = asyncio.run(run_impatient())
    assert done[0] == "long" and outs[0].batch_size == 1  # its own batch: the budget keeps the short ones out


def test_prompts_over_their_token_limits_are_refused_before_any_model_call(tiny_model, media):
    from paravt_agent.errors import PromptTooLong

    agent = Agent(model=tiny_model, config=SHORT.model_copy(update={"max_question_tokens": 50}))
    n = agent.policy.count_text_tokens("red " * 60)
    assert n > 50
    with pytest.raises(PromptTooLong, match=rf"the question is 240 characters \({n} tokens\); the limit is 50 tokens"):
        agent.answer(media["video"], "red " * 60, n_frames=2)
    with pytest.raises(PromptTooLong, match="option B"):
        agent.answer(media["video"], "Which?", ["red", "x" * 600], n_frames=2)
    window = agent.policy.context_length
    wide = Agent(model=tiny_model, config=SHORT.model_copy(
        update={"planner_sampling": Sampling(max_new_tokens=window)}))
    with pytest.raises(PromptTooLong, match=f"over the model's {window}-token context"):
        wide.answer(media["video"], "Which colour?", n_frames=2)
    assert agent.answer(media["video"], "red " * 10, n_frames=2).trace.turns  # within its limit: answered


def test_local_backend_end_to_end(tiny_model, media):
    agent = Agent(model=tiny_model, config=SHORT)
    ans = agent.answer(media["video"], "Which colour is shown at 5 seconds?", ["red", "green"], n_frames=4)
    t = ans.trace
    assert t.turns and t.turns[0].text.startswith("<think>\n")
    assert t.turns[0].prompt_tokens > 0 and t.turns[0].completion_tokens > 0
    assert len(t.overview_timestamps) == 4
    assert ans.records and ans.records[0].role == "planner" and ans.records[0].generation.has_tokens
    # the local backend splits each call's time: prefill (vision tower + prompt) and decode
    planner = next(p for p in t.phases if p.name in ("planner", "answer"))
    assert set(planner.detail) == {"encode", "prefill", "decode"} and planner.detail["prefill"] > 0
    assert sum(planner.detail.values()) <= planner.seconds + 1e-3


def test_missing_model_dir_is_clear(tmp_path):
    with pytest.raises(PolicyError, match="paravt-train toy"):
        LocalPolicy(tmp_path / "none")


@pytest.fixture(scope="module")
def hf_server(tiny_model, tmp_path_factory):
    port = free_port()
    cache = tmp_path_factory.mktemp("hfcache")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    # the `transformers` command as a module of this Python (no console script needed: a GPU machine given the
    # wheels with --target has none)
    exe = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]
    usage = subprocess.run([*exe, "serve", "--help"], capture_output=True, text=True, env=env, timeout=120).stdout
    if "FORCE_MODEL" not in usage:  # transformers 5.0 serves only models it downloads (no local path argument)
        pytest.skip("this transformers' `serve` takes no model directory (a later 5.x does)")
    proc = subprocess.Popen([*exe, "serve", tiny_model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    import urllib.request

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/models", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("transformers serve exited") from None
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("transformers serve did not start")
    yield url
    proc.terminate()
    proc.wait(10)


def test_openai_backend_against_transformers_serve(hf_server, tiny_model, media):
    # transformers serve has no continue_final_message: the backend refuses a prefix it cannot pin ...
    with pytest.raises(ConfigError, match="think prefix"):
        Agent(backend="openai", endpoint=hf_server, model=tiny_model, config=SHORT,
              policy_kwargs={"prefill": False})
    # ... and runs without one
    agent = Agent(backend="openai", endpoint=hf_server, model=tiny_model,
                  config=SHORT.model_copy(update={"think_prefix": ""}), policy_kwargs={"prefill": False})
    ans = agent.answer(media["video"], "Which colour?", ["red", "green"], n_frames=4)
    turn = ans.trace.turns[0]
    assert turn.prompt_tokens > 100  # the frames reached the model as images
    assert turn.completion_tokens > 0 and not ans.trace.run_errors  # an untrained model may say nothing usable


# --------------------------------------------------------------------------- SGLang /generate


def test_sglang_backend_against_sglang(sglang_toy, toy_policy_dir, media):
    """Against SGLang itself (0.5.23 on CPU) serving the same model: the same tokens as the in-process backend and
    logprobs within 1e-4 (SGLang's own Qwen3-VL: its vision tower, mRoPE, sampler), the request carries one
    placeholder per image, and the recorded prompt is the expanded sequence the server consumed."""
    pol = SGLangPolicy(model=toy_policy_dir, endpoint=sglang_toy.url + "/v1")
    local = LocalPolicy(toy_policy_dir)
    msgs = _toy_messages(media, n=3)
    s = Sampling(max_new_tokens=24)
    payload, seen = pol.build_request(msgs, s, prefix="<think>\n")
    tok = pol.processor.tokenizer
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert payload["input_ids"].count(pad) == 3 and len(payload["image_data"]) == 3  # the server expands them
    assert payload["input_ids"][-2:] == tok("<think>\n", add_special_tokens=False)["input_ids"]
    assert (payload["sampling_params"]["top_k"], payload["return_logprob"]) == (-1, True)
    gen = asyncio.run(pol.generate(msgs, s, prefix="<think>\n"))
    ref = local.generate_sync(msgs, s, prefix="<think>\n")
    assert gen.prompt_ids == ref.prompt_ids and gen.prefix_ids == ref.prefix_ids  # expanded, as consumed
    assert gen.output_ids == ref.output_ids and gen.text == ref.text
    assert gen.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert gen.image_grid_thw == ref.image_grid_thw and not gen.retokenized
    assert pol.round_trips == 0 and gen.weight_version == "default"


def _loads(url: str) -> dict:
    return httpx.get(url + "/v1/loads", timeout=30).json()["loads"][0]


def _wait_running(url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while _loads(url)["num_running_reqs"] == 0:
        assert time.time() < deadline, "no request started"
        time.sleep(0.02)


def test_sglang_fan_out_timeouts_and_aborts_on_sglang(sglang_toy, toy_policy_dir, toy_rl, media):
    """SGLang's batching, aborts and disconnects, as the backend meets them: the agent's parallel fan-out (K
    sub-agents at once, batched by the server) answers as the in-process agent does, and 8 concurrent turns get
    the tokens of 8 sequential ones; a request aborted on the server (``/abort_request``: a weight update's
    ``abort`` pause does the same) comes back HTTP 200 with finish reason ``abort``, and the backend retries it
    instead of returning it as a turn; a client that times out disconnects, and SGLang drops the request (its
    slot is free long before the generation would have finished)."""
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.question.startswith("When"))  # grounding: the toy policy crops 4 windows
    via = Agent(model=toy_policy_dir, backend="sglang", endpoint=sglang_toy.url).answer(w.video, q.question,
                                                                                       n_frames=8)
    ref = Agent(model=toy_policy_dir).answer(w.video, q.question, n_frames=8)
    assert via.ok and via.text == ref.text and via.span == ref.span
    assert [len(t.calls) for t in via.trace.turns] == [len(t.calls) for t in ref.trace.turns]
    assert len(via.trace.turns[0].calls) > 1  # the sub-agents ran side by side on the server

    pol = SGLangPolicy(model=toy_policy_dir, endpoint=sglang_toy.url, max_retries=1)
    msgs = [_toy_messages(media, n=k) for k in range(1, 9)]
    s = Sampling(max_new_tokens=16)
    alone = [asyncio.run(pol.generate(m, s, prefix="<think>\n")) for m in msgs]

    async def together():
        return await asyncio.gather(*(pol.generate(m, s, prefix="<think>\n") for m in msgs))

    for a, b in zip(alone, asyncio.run(together()), strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)

    payload, _ = pol.build_request(msgs[0], Sampling(max_new_tokens=3000), "<think>\n")
    payload["sampling_params"]["ignore_eos"] = True  # long enough to abort mid-way
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("data", asyncio.run(pol._post(payload))))
    t.start()
    _wait_running(sglang_toy.url)
    assert httpx.post(sglang_toy.url + "/abort_request", json={"abort_all": True}).status_code == 200
    t.join(300)
    meta = out["data"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(out["data"]["output_ids"]) == 3000  # the retry

    slow = SGLangPolicy(model=toy_policy_dir, endpoint=sglang_toy.url, timeout=1.0, max_retries=0)
    t0 = time.time()
    with pytest.raises(PolicyError, match="cannot reach"):
        asyncio.run(slow._post({**payload, "sampling_params": {**payload["sampling_params"],
                                                                "max_new_tokens": 15000}}))
    while _loads(sglang_toy.url)["num_running_reqs"]:
        assert time.time() - t0 < 10, "SGLang kept generating for a client that had gone"  # 15000 tokens: ~30 s
        time.sleep(0.1)


def test_sglang_retries_5xx_and_aborted_replies(tiny_model, media, json_server):
    """A 5xx and an aborted reply (a weight update interrupted it) are retried, never returned as a turn."""
    from transformers import AutoProcessor

    tok = AutoProcessor.from_pretrained(tiny_model).tokenizer
    ids = tok("plan</think>\n<answer>B</answer>", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(
        "<|im_end|>")]
    replies = [(503, {}), (200, {"text": "", "output_ids": ids[:2], "meta_info": {"finish_reason": {"type": "abort"},
                                                                                 "output_token_logprobs": []}})]
    done = {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": len(ids),
                                             "output_token_logprobs": [[-0.1, t, None] for t in ids]}}
    srv = json_server(lambda path, body: replies.pop(0) if replies else (200, done))
    seen = srv.seen
    pol = SGLangPolicy(model=tiny_model, endpoint=srv.url, max_retries=3)
    gen = asyncio.run(pol.generate(overview_messages(media, n=2), Sampling(max_new_tokens=8)))
    assert len(seen) == 3 and gen.text.endswith("<answer>B</answer>") and gen.finish_reason == "stop"
    replies.extend([(200, {"meta_info": {"finish_reason": {"type": "abort"}}})] * 4)
    with pytest.raises(PolicyError, match="aborted"):
        asyncio.run(pol.generate(overview_messages(media, n=2), Sampling(max_new_tokens=8)))


def test_sglang_unreachable(tiny_model, media):
    pol = SGLangPolicy(model=tiny_model, endpoint=f"http://127.0.0.1:{free_port()}", max_retries=0)
    with pytest.raises(PolicyError, match="paravt serve"):
        asyncio.run(pol.generate(overview_messages(media, n=2), Sampling(max_new_tokens=8)))


def test_frames_reach_the_model_at_the_protocol_size(tmp_path, media, own_sglang):
    """Qwen3-VL's processor upscales every image to min_pixels 65536 (224x224 -> 256x256: 64 visual tokens
    instead of 49). Every path keeps the protocol's size: the local backend, SFT examples, the trainer's pixel
    values, and SGLang itself (0.5.23 on CPU) told the family's frame sizes as `paravt serve` tells it
    (--mm-process-config); a server that still resizes is refused with an error naming the cause (its processor's
    pixel bounds) and the fix, never trained on silently."""
    import numpy as np
    import torch

    from paravt_agent.policy.chat import ChatTokenizer
    from paravt_agent.prompts import planner_messages
    from paravt_train.sft import build_example
    from paravt_train.toy.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path / "qwen-like", ["red green blue"] * 4, size="test", min_pixels=65536))
    frames = np.stack([np.full((224, 224, 3), 40 * i, np.uint8) for i in range(3)])
    msgs = planner_messages("sys", frames, [0.0, 1.0, 2.0], 3.0, "Which colour?")
    local = LocalPolicy(model)
    enc = local.encode(msgs)
    assert enc.image_grid_thw == [(1, 14, 14)] * 3  # 224 / 16 = 14 patches a side: 49 visual tokens a frame
    assert enc.ids.count(local.chat.image_token_id) == 3 * 49
    proc = local.processor
    ex = build_example([*msgs, {"role": "assistant", "content": "red"}], proc)
    assert ex["input_ids"].count(local.chat.image_token_id) == 3 * 49
    assert ChatTokenizer(proc).image_inputs(list(frames))["image_grid_thw"].tolist() == [[1, 14, 14]] * 3
    naive = proc.image_processor(images=list(frames), return_tensors="pt")["image_grid_thw"]
    assert naive.tolist() == [[1, 16, 16]] * 3  # what the processor alone would have done
    # SGLang: a server started without the frame sizes resizes: the client says why and how to fix it
    raw, served = own_sglang((model, {"extra": ["--mm-process-config", "{}"]}), model)
    flag = '{"image":{"size":{"shortest_edge":1024,"longest_edge":50176}}}'
    with pytest.raises(PolicyError, match=re.escape(
            "consumed 192 visual tokens but this client computed 147") + ".*keeps images between 65536 and 50176 "
            ".*a 224x224 frame is 49 visual tokens here and 64 there.*" + re.escape(f"--mm-process-config '{flag}'")):
        asyncio.run(SGLangPolicy(model=model, endpoint=raw.url).generate(msgs, Sampling(max_new_tokens=4)))
    gen = asyncio.run(SGLangPolicy(model=model, endpoint=served.url).generate(msgs, Sampling(max_new_tokens=4)))
    assert gen.prompt_ids == enc.prompt_ids and gen.image_grid_thw == [(1, 14, 14)] * 3
    ref = local.generate_sync(msgs, Sampling(max_new_tokens=4))
    assert gen.output_ids == ref.output_ids and gen.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert torch.equal(torch.tensor(gen.image_grid_thw), torch.tensor(ref.image_grid_thw))


def test_frames_are_encoded_once_and_sent_as_the_same_bytes():
    import base64
    import io

    import numpy as np
    from PIL import Image

    from paravt_agent.policy.base import _EncodedFrames
    from paravt_agent.policy.openai_backend import to_openai_messages

    cache = _EncodedFrames(max_bytes=10_000)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    first = cache.get(a, "PNG")
    assert cache.get(a.copy(), "PNG") == first and (cache.hits, cache.misses) == (1, 1)  # same pixels: reused
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(first))))
    assert np.array_equal(decoded, a)  # lossless
    b = a.copy()
    b[0, 0, 0] ^= 1
    assert cache.get(b, "PNG") != first and cache.misses == 2  # one pixel differs: its own entry
    for _ in range(5):
        cache.get(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "PNG")
    assert 0 < cache.bytes <= cache.max_bytes  # bounded
    # a planner's second turn sends its overview frames as the first turn's bytes
    frames = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(3)]
    turn1 = [{"role": "user", "content": [{"type": "image", "image": f} for f in frames] + [{"type": "text",
                                                                                             "text": "q"}]}]
    turn2 = [*turn1, {"role": "assistant", "content": "x"}, {"role": "user", "content": "<tool_response>"}]
    assert to_openai_messages(turn2)[0] == to_openai_messages(turn1)[0]


def test_sglang_requests_are_shaped_for_the_radix_cache(tiny_model, media, json_server):
    """SGLang's radix cache shares work only between requests whose token prefix and images are the same:
    the G rollouts of a prompt send the same ids and the same image bytes, and the planner's next turn
    sends the previous turn's ids (prompt, prefix, its own output) unchanged, then the new tokens."""
    from transformers import AutoProcessor

    from paravt_agent.types import Continuation

    tok = AutoProcessor.from_pretrained(tiny_model).tokenizer
    out = tok("plan</think>\n<tool_call>", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(
        "<|im_end|>")]
    reply = {"output_ids": out, "meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": len(out),
                                              "output_token_logprobs": [[-0.1, t, None] for t in out]}}
    srv = json_server(lambda path, body: (200, reply))
    pol = SGLangPolicy(model=tiny_model, endpoint=srv.url)
    msgs = overview_messages(media, n=4)

    async def group():
        return await asyncio.gather(*(pol.generate(msgs, Sampling(temperature=0.7, max_new_tokens=8, seed=s),
                                                   prefix="<think>\n") for s in range(4)))

    gens = asyncio.run(group())
    first = srv.bodies[0]
    assert len(srv.bodies) == 4 and len(first["image_data"]) == 4
    assert all(r["input_ids"] == first["input_ids"] and r["image_data"] == first["image_data"] for r in srv.bodies)
    turn2 = [*msgs, {"role": "assistant", "content": gens[0].text},
             {"role": "user", "content": "<tool_response>\n[1] crop: red\n</tool_response>"}]
    asyncio.run(pol.generate(turn2, Sampling(max_new_tokens=8), "<think>\n", Continuation(len(msgs), gens[0])))
    again = srv.bodies[-1]
    done = first["input_ids"] + out  # turn 1's prompt and prefix, then its own tokens
    assert again["input_ids"][: len(done)] == done and len(again["input_ids"]) > len(done)
    assert again["image_data"] == first["image_data"]


# --------------------------------------------------------------------------- SGLang 0.5.23's contract


def _toy_messages(media, n=2):
    msgs = overview_messages(media, n=n)
    for m in msgs:  # the toy model's protocol: 32x32 frames
        if not isinstance(m["content"], str):
            for p in m["content"]:
                if p["type"] == "image":
                    p["image"] = p["image"][:32, :32]
    return msgs


def _respelled(gen, tok, eos: int):
    """``gen`` with its output spelled token by token in single characters: the same text, ids the tokenizer
    would never produce (a decode -> tokenise round trip merges them)."""
    import dataclasses

    body = tok.decode([t for t in gen.output_ids if t != eos], skip_special_tokens=False)
    chars = [tok.convert_tokens_to_ids(c) for c in "1717"]
    assert None not in chars and tok("1717", add_special_tokens=False)["input_ids"] != chars
    ids = tok(body, add_special_tokens=False)["input_ids"] + chars + [eos]
    return dataclasses.replace(gen, text=gen.prefix + body + "1717", output_ids=ids, logprobs=[-0.5] * len(ids))


def test_sglang_records_the_prompt_ids_the_server_consumed(sglang_toy, toy_policy_dir, media, json_server):
    """SGLang 0.5.21+ uses multimodal input_ids verbatim and reports what it consumed (return_prompt_token_ids):
    checked against SGLang itself.
    A planner turn continuing sampled tokens the tokenizer would spell otherwise is recorded exactly as sent —
    no false "sizes frames differently" error, no round-tripped ids the server never saw. Only a server that
    reports no ids gets the old round-trip emulation, and the generation says so (prompt_source)."""
    from paravt_agent.policy.chat import continued_ids
    from paravt_agent.types import Continuation

    pol = SGLangPolicy(model=toy_policy_dir, endpoint=sglang_toy.url)
    tok, eos = pol.chat.tokenizer, pol.chat.eos_id
    msgs = _toy_messages(media)
    first = asyncio.run(pol.generate(msgs, Sampling(max_new_tokens=8), prefix="<think>\n"))
    assert first.prompt_source == "server" and first.weight_version == "default"
    prev = _respelled(first, tok, eos)
    turn2 = [*msgs, {"role": "assistant", "content": prev.text},
             {"role": "user", "content": "<tool_response>\n[1] crop: red\n</tool_response>"}]
    payload, seen = pol.build_request(turn2, Sampling(max_new_tokens=8), "<think>\n", Continuation(len(msgs), prev))
    assert payload["return_prompt_token_ids"] is True
    sent = continued_ids(prev, eos)
    # what the old client assumed the server did: the round trip changes the prompt's length
    assert len(pol.chat.round_trip(payload["input_ids"])) != len(payload["input_ids"])
    gen = asyncio.run(pol.generate(turn2, Sampling(max_new_tokens=8), "<think>\n", Continuation(len(msgs), prev)))
    assert gen.prompt_ids[: len(sent)] == sent and gen.prompt_ids == seen["ids"][: len(gen.prompt_ids)]
    assert gen.prompt_source == "server" and not gen.retokenized and pol.round_trips == 0 and pol.server_ids == 2
    # a server that reports no ids (SGLang < 0.5.19): the round trip is emulated, the turn flagged
    out = tok("ok", add_special_tokens=False)["input_ids"] + [eos]
    old = json_server(lambda path, body: (200, {"output_ids": out, "meta_info": {
        "finish_reason": {"type": "stop"}, "completion_tokens": len(out),
        "output_token_logprobs": [[-0.1, t, None] for t in out]}}))
    legacy = SGLangPolicy(model=toy_policy_dir, endpoint=old.url)
    g = asyncio.run(legacy.generate(turn2, Sampling(max_new_tokens=8), "<think>\n", Continuation(len(msgs), prev)))
    assert g.prompt_source == "round_trip" and g.retokenized and legacy.round_trips == 1
    assert g.prompt_ids[: len(sent)] != sent


def _penalised_copy(model_dir: str, out) -> str:
    import json as _json
    import shutil

    shutil.copytree(model_dir, out)
    cfg = _json.loads((out / "generation_config.json").read_text())
    cfg.update(repetition_penalty=1.8, top_k=3)  # SGLang refuses a penalty above 2
    (out / "generation_config.json").write_text(_json.dumps(cfg))
    return str(out)


def test_sglang_and_local_sample_the_distribution_the_trainer_scores(own_sglang, tiny_model, media, tmp_path):
    """A model whose generation_config.json sets repetition_penalty 1.8 and top_k 3. SGLang itself (0.5.23 on CPU)
    fills a request's unset sampling keys from that file (--sampling-defaults model, its default) on its OpenAI
    routes, not on /generate; the sglang backend sends every key the scored distribution depends on anyway (a
    server that fills them would otherwise sample another distribution than the trainer scores), so it samples
    the raw model (greedy = the model's argmax, logprobs = the model's); the local backend ignores the file the
    same way."""
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = _penalised_copy(tiny_model, tmp_path / "penalised")  # random weights: long, repetitive outputs
    [stub] = own_sglang(model_dir)
    pol = SGLangPolicy(model=model_dir, endpoint=stub.url)
    msgs = overview_messages(media, n=2)
    s = Sampling(max_new_tokens=24)
    payload, seen = pol.build_request(msgs, s, "<think>\n")
    p = payload["sampling_params"]
    assert (p["repetition_penalty"], p["frequency_penalty"], p["presence_penalty"], p["top_k"], p["min_p"]) == (
        1.0, 0.0, 0.0, -1, 0.0)
    gen = asyncio.run(pol.generate(msgs, s, "<think>\n"))
    assert len(gen.output_ids) == 24 and len(set(gen.output_ids)) < 24  # a token repeats: a penalty would act
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    chat = pol.chat
    ids = [*gen.prompt_ids, *gen.prefix_ids, *gen.output_ids]
    n0 = len(gen.prompt_ids) + len(gen.prefix_ids)
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
             "mm_token_type_ids": chat.mm_token_types(torch.tensor([ids])),
             **chat.image_inputs([m for m in gen_images(msgs)])}
    with torch.no_grad():
        logits = model(**batch).logits[0, n0 - 1: len(ids) - 1].float()
    lp = torch.log_softmax(ban(logits, chat.placeholder_ids), -1)  # the vision placeholders banned, as sampled
    assert gen.output_ids == lp.argmax(-1).tolist()  # greedy on the raw model
    assert gen.logprobs == pytest.approx(lp.gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0].tolist(), abs=1e-4)
    local = LocalPolicy(model_dir).generate_sync(msgs, s, "<think>\n")
    assert local.output_ids == gen.output_ids
    # the same request without the explicit keys: /generate leaves the file out (0.5.23) ...
    bare = {**payload, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0}}
    raw = httpx.post(stub.url + "/generate", json=bare, timeout=120).json()
    assert raw["output_ids"] == gen.output_ids
    # ... the chat route applies it (penalty 1.8, top-k 3) to what a request leaves unset
    chat = {"model": model_dir, "messages": [{"role": "user", "content": "red green blue"}], "max_tokens": 24,
            "temperature": 0.0}
    said = [httpx.post(stub.url + "/v1/chat/completions", json=body, timeout=120).json()
            for body in (chat, {**chat, "repetition_penalty": 1.0, "top_k": -1})]
    assert all("choices" in r for r in said), said
    assert said[0]["choices"][0]["message"]["content"] != said[1]["choices"][0]["message"]["content"]


def test_sglang_itself_never_samples_a_banned_token_and_reports_the_banned_distribution(sglang_toy, toy_policy_dir,
                                                                                         tmp_path):
    """The vision placeholders are banned everywhere a distribution is sampled or scored: the sglang backend sends
    them as ``logit_bias`` (SGLang 0.5.23 adds it before sampling and before the logprobs it returns), and the
    trainer's ``token_logprobs`` bans the same ids. Shown with the end of turn banned too: greedy, the toy policy
    ends its turn after a few tokens; with the ban, SGLang itself runs on to max_new_tokens, and every logprob it
    reports is the trainer's for the banned distribution (not the raw model's)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from paravt_agent.video import VideoReader
    from paravt_train.rl.rollout import TokenSequence
    from paravt_train.rl.scoring import collate, token_logprobs
    from paravt_train.toy.render import write_segments

    write_segments(tmp_path / "v.mp4", [((230, 25, 75), 2.0), ((0, 130, 200), 2.0)], fps=4, width=64, height=64)
    clip = VideoReader(str(tmp_path / "v.mp4")).overview(n=2)
    msgs = planner_messages("You are a video understanding agent.", clip.frames, clip.timestamps, 4.0,
                            "Which colour?")
    free = SGLangPolicy(model=toy_policy_dir, endpoint=sglang_toy.url)
    payload, _ = free.build_request(msgs, Sampling(max_new_tokens=8), "<think>\n")
    assert payload["sampling_params"]["logit_bias"] == {str(t): BANNED_LOGIT for t in free.chat.placeholder_ids}
    ended = asyncio.run(free.generate(msgs, Sampling(max_new_tokens=60), "<think>\n"))
    assert ended.finish_reason == "stop" and ended.completion_tokens < 60, ended  # greedy, it ends its turn
    banned = SGLangPolicy(model=toy_policy_dir, endpoint=sglang_toy.url)
    eos = banned.chat.eos_id
    banned.chat.placeholder_ids.append(eos)
    s = Sampling(max_new_tokens=ended.completion_tokens + 6)
    gen = asyncio.run(banned.generate(msgs, s, "<think>\n"))
    assert gen.completion_tokens == s.max_new_tokens and eos not in gen.output_ids
    ids = [*gen.prompt_ids, *gen.prefix_ids, *gen.output_ids]
    n0 = len(ids) - len(gen.output_ids)
    seq = TokenSequence(role="banned", input_ids=ids, loss_mask=[0] * n0 + [1] * len(gen.output_ids),
                        logprobs=[0.0] * n0 + list(gen.logprobs),
                        images=list(gen_images(msgs)))
    model = AutoModelForImageTextToText.from_pretrained(toy_policy_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        batch = collate([seq], banned.chat)
        lp, _ = token_logprobs(model, batch, 1.0)
        raw, _ = token_logprobs(model, {**batch, "banned_ids": torch.zeros(0, dtype=torch.long)}, 1.0)
    scored = lp[0, n0 - 1:].tolist()
    assert gen.logprobs == pytest.approx(scored, abs=1e-4)
    # where the raw model ended its turn, the banned distribution is renormalised: scored raw, it would differ
    assert max(abs(a - b) for a, b in zip(raw[0, n0 - 1:].tolist(), scored, strict=True)) > 0.1


def gen_images(msgs):
    from paravt_agent.policy.base import images_of

    return images_of(msgs)


@pytest.mark.parametrize("server", ["stand-in", "sglang"])
def test_the_sglang_test_server_holds_sglang_0_5_23s_contract(server, request, toy_policy_dir):
    """The stand-in refuses what SGLang 0.5.23 refuses (its own api_types decide) and behaves as SGLang itself
    does on the same requests: stop strings end generation and are trimmed, weight_version is a string,
    /model_info and /server_info exist, tensor updates need a session."""
    if server == "sglang":
        stub = request.getfixturevalue("sglang_toy")
    else:
        stub = request.getfixturevalue("sglang_stub")(toy_policy_dir)
    info = httpx.get(stub.url + "/server_info").json()
    assert info["version"] == (Path(__file__).resolve().parents[1] / ".sglang-contract" / "VERSION").read_text().strip()
    assert httpx.get(stub.url + "/model_info").json()["weight_version"] == "default"
    ids = [int(x) for x in range(20, 40)]
    bad = httpx.post(stub.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4,
                                                                                          "foo": 1}})
    assert bad.status_code == 400 and "unknown field `foo`" in str(bad.json()["error"])
    bad = httpx.post(stub.url + "/generate", json={"input_ids": ids, "return_logprob": "yes"})
    assert bad.status_code == 400
    base = {"input_ids": ids, "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}}
    full = httpx.post(stub.url + "/generate", json=base, timeout=120).json()
    text = full["text"]
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    cut = httpx.post(stub.url + "/generate", json={**base, "sampling_params": {**base["sampling_params"],
                                                                               "stop": [stop]}}, timeout=120).json()
    meta = cut["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop} and cut["text"] == text[: text.find(stop)]
    assert cut["output_ids"] == full["output_ids"][: len(cut["output_ids"])] and meta["completion_tokens"] < 40
    assert meta["weight_version"] == "default"
    from paravt_train.sync.streamed import serialize_named_tensors

    one = serialize_named_tensors([("x", __import__("torch").zeros(2))])  # a real payload: refused for the session
    refused = httpx.post(stub.url + "/update_weights_from_tensor", json={"serialized_named_tensors": [one]})
    assert refused.status_code == 400 and "between begin_weight_update() and end_weight_update()" in refused.text
    assert httpx.post(stub.url + "/end_weight_update", json={}).status_code == 400  # no session open


def test_a_lora_run_rolls_out_with_its_adapter(tiny_model, media, json_server):
    """SGLang applies a LoRA adapter only to requests that name it: the rollout policy of a run with
    ``weight_sync: lora`` names the adapter the trainer pushes (``lora_name``) in every request, and a run without
    LoRA names none (a request naming an adapter the server does not hold is refused)."""
    from transformers import AutoProcessor

    from paravt_agent.policy.registry import make_rollout_policy

    tok = AutoProcessor.from_pretrained(tiny_model).tokenizer
    ids = tok("plan</think>\n<answer>B</answer>", add_special_tokens=False)["input_ids"]
    done = {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": len(ids),
                                             "output_token_logprobs": [[-0.1, t, None] for t in ids]}}
    srv = json_server(lambda path, body: (200, done))
    for lora in ("paravt-online", None):
        pol = make_rollout_policy("sglang", tiny_model, srv.url, lora=lora)
        asyncio.run(pol.generate(overview_messages(media, n=2), Sampling(max_new_tokens=8)))
        assert srv.bodies[-1].get("lora_path") == lora
