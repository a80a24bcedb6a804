"""Shared prompt work in the local backend (paravt_agent.policy.reuse): the vision tower once per
distinct frame, a repeated prompt prefilled once, a continued sequence's KV reused. Every output
(token ids, logprobs) equals the same requests run without any reuse."""

import pytest
import torch

from paravt_agent.policy.local import LocalPolicy
from paravt_agent.policy.reuse import weights_version
from paravt_agent.prompts import planner_messages
from paravt_agent.types import Continuation, Sampling
from tests.conftest import NumericBound, assert_same_tokens

FLOAT32_REUSE = NumericBound("reuse", "float32")


def overview(media, n):
    from paravt_agent.video import VideoReader

    clip = VideoReader(media["video"]).overview(n=n)
    return planner_messages("You are a video understanding agent.", clip.frames, clip.timestamps, 40.0, "Which colour?")


def same_outputs(a, b, bound: NumericBound = FLOAT32_REUSE) -> tuple[float, float]:
    """Asserts the same prompt, tokens and logprobs within ``bound`` (float32: 1e-5; bf16: the same tokens up to a
    near-tie, conftest's ``assert_same_tokens``); returns the largest difference and the largest bound held to."""
    assert len(a) == len(b)
    worst = held = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.prompt_ids == y.prompt_ids
        d, h = assert_same_tokens(x.output_ids, x.logprobs, y.output_ids, y.logprobs, bound)
        worst, held = max(worst, d), max(held, h)
    return worst, held


def worse(*pairs) -> tuple[float, float]:
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


@pytest.fixture(scope="module")
def pair(tiny_model, device, dtype):
    return (LocalPolicy(tiny_model, reuse=False, device=device, dtype=dtype),
            LocalPolicy(tiny_model, device=device, dtype=dtype))


@pytest.mark.dtype
def test_repeated_prompt_and_mixed_batch_equal_plain_generation(pair, media, tiny_model, numeric_bound,
                                                               record_property):
    plain, shared = pair
    bound = numeric_bound("reuse", tiny_model)
    g = [(overview(media, 8), Sampling(temperature=1.0, max_new_tokens=12, seed=s), "<think>\n") for s in range(4)]
    other = [(overview(media, 4), Sampling(temperature=0.0, max_new_tokens=12), ""),
             (overview(media, 6), Sampling(temperature=1.0, max_new_tokens=12, seed=9), "<think>\n")]
    # the G rollouts of one prompt: one prefill, the tower once per distinct frame
    before = shared.vision_cache.misses
    worst = same_outputs(plain.generate_batch(g), shared.generate_batch(g), bound)
    assert 0 < shared.vision_cache.misses - before <= 8
    # rows of different lengths, two of them the same prompt: left-padded shared KV
    mixed = [g[0], other[0], g[1], other[1]]
    worst = worse(worst, same_outputs(plain.generate_batch(mixed), shared.generate_batch(mixed), bound))
    assert shared.vision_cache.hits > 0  # these frames were seen before
    bound.check(record_property, *worst)


@pytest.mark.dtype
def test_a_turn_that_continues_its_own_sequence_prefills_only_the_new_tokens(pair, media, tiny_model, numeric_bound,
                                                                              record_property):
    plain, shared = pair
    bound = numeric_bound("reuse", tiny_model)
    msgs = overview(media, 8)
    s = Sampling(temperature=0.0, max_new_tokens=10)
    first = [p.generate_sync(msgs, s, "<think>\n") for p in pair]
    worst = same_outputs([first[0]], [first[1]], bound)

    def turn2(gen):
        return [*msgs, {"role": "assistant", "content": gen.text},
                {"role": "user", "content": "<tool_response>\n[1] crop: red 1 2; blue 3\n</tool_response>"}]

    hits, reused = shared.prefix_cache.hits, shared.prefix_cache.reused_tokens
    second = [p.generate_sync(turn2(f), s, "<think>\n", Continuation(len(msgs), f)) for p, f in zip(pair, first,
                                                                                                  strict=True)]
    worst = worse(worst, same_outputs([second[0]], [second[1]], bound))
    assert shared.prefix_cache.hits == hits + 1
    # the whole first turn (prompt, think prefix and its own tokens) came from the cache
    assert shared.prefix_cache.reused_tokens - reused >= len(first[1].prompt_ids) + len(first[1].output_ids) - 1
    # G continuations in one batch, each of its own stored sequence
    gs = [shared.generate_sync(msgs, Sampling(temperature=1.0, max_new_tokens=8, seed=k), "<think>\n")
          for k in range(3)]
    reqs = [(turn2(x), s, "<think>\n", Continuation(len(msgs), x)) for x in gs]
    hits = shared.prefix_cache.hits
    worst = worse(worst, same_outputs(plain.generate_batch(reqs), shared.generate_batch(reqs), bound))
    assert shared.prefix_cache.hits == hits + 3
    bound.check(record_property, *worst)


def test_caches_follow_the_weights(tiny_model, media):
    """An in-place weight change (an optimizer step of the in-process trainer) empties both caches: the
    next answer is the new weights', equal to a policy that never cached."""
    plain, shared = LocalPolicy(tiny_model, reuse=False), LocalPolicy(tiny_model)
    msgs = overview(media, 6)
    s = Sampling(temperature=0.0, max_new_tokens=8)
    shared.generate_sync(msgs, s)
    assert shared.vision_cache.entries and shared.prefix_cache.entries
    version = weights_version(shared.model.model.visual)
    with torch.no_grad():
        for p in (plain, shared):
            for w in p.model.parameters():
                w.mul_(1.5)
    assert weights_version(shared.model.model.visual) != version
    misses = shared.vision_cache.misses
    same_outputs([plain.generate_sync(msgs, s)], [shared.generate_sync(msgs, s)])
    assert shared.vision_cache.misses > misses  # recomputed, not served stale


def test_vision_cache_is_bounded_by_bytes(tiny_model, media):
    shared = LocalPolicy(tiny_model, vision_cache_mb=0)
    shared.generate_sync(overview(media, 6), Sampling(max_new_tokens=4))
    assert not shared.vision_cache.entries and shared.vision_cache.bytes == 0


def test_prompt_encoding_equals_the_processor_and_is_remembered(tiny_model):
    """The chat tokenizer expands each image's placeholder itself, with image-processor outputs remembered
    by frame bytes: ids, pixel values and grids equal the processor's own, for any frame size."""
    import numpy as np
    from transformers import AutoProcessor

    from paravt_agent.policy.chat import ChatTokenizer, to_chat_messages

    proc = AutoProcessor.from_pretrained(tiny_model)
    chat = ChatTokenizer(proc)
    rng = np.random.default_rng(0)
    for n, h, w in [(1, 32, 32), (4, 64, 96), (3, 224, 224)]:
        frames = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(n)]
        msgs = planner_messages("sys", frames, [float(i) for i in range(n)], 40.0, "Which colour?")
        hf, pil = to_chat_messages(msgs)
        ref = proc(text=[chat.render(hf, True)], images=pil, return_tensors="pt", **chat.size_kwargs(pil))
        for _ in range(2):  # the second time from memory
            enc = chat.encode(msgs)
            assert enc.ids == ref["input_ids"][0].tolist()
            assert torch.equal(enc.pixel_values, ref["pixel_values"])
            assert enc.image_grid_thw == [tuple(g.tolist()) for g in ref["image_grid_thw"]]
    assert len(chat._memo) == 3
    frames[0][0, 0, 0] ^= 1  # one pixel differs: encoded anew
    enc = chat.encode(planner_messages("sys", frames, [float(i) for i in range(n)], 40.0, "Which colour?"))
    assert len(chat._memo) == 4 and not torch.equal(enc.pixel_values, ref["pixel_values"])
