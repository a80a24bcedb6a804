"""Rollouts for PARA-GRPO, produced by the same ``paravt_agent`` graph that serves users.

One prompt (video, question, answer) → G episodes run concurrently through
:meth:`paravt_agent.Agent.arun_state` from ONE prepared initial state (the overview
is decoded once per prompt and n). Every model call of an episode comes back as a
:class:`~paravt_agent.policy.base.Generation` with token ids and logprobs; an
episode becomes token sequences:

* the planner: the final turn's prompt ids + think prefix + sampled ids. Earlier
  turns are inside that prompt *as their exact sampled ids* (the policy continues
  from ids, never re-tokenising model output), the K sub-agent summaries sit in it
  once per tool turn as ONE ``<tool_response>`` user turn. ``loss_mask`` is 1 on
  sampled tokens only: the system prompt, frames, tool responses and the pinned
  ``<think>\\n`` prefix are context (the reward still sees the prefix: it scores
  the transcript, prefix included);
* each sub-agent: its prompt ids + sampled summary ids (optional, sharing the
  episode's advantage).

nFrames gating draws the overview size n per prompt from a generator seeded by
``(seed, prompt id)``: all G rollouts of the prompt see exactly n frames, and the
draw is the same on every rank and after a restart. The prompt cache is keyed by
the video's identity (path, size, mtime), the question, the options and n.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from paravt_agent.agent import Agent, Answer
from paravt_agent.errors import ParaVTError
from paravt_agent.policy.base import continued_ids, text_of
from paravt_train.rewards import RewardBreakdown, RewardConfig, score, transcript

__all__ = [
    "Episode",
    "PromptCache",
    "RolloutError",
    "TokenSequence",
    "assemble",
    "episode_transcript",
    "gate_frames",
    "run_group",
]


class RolloutError(ParaVTError):
    """A rollout cannot be turned into training tokens (e.g. a backend that returns no token ids)."""


def gate_frames(seed: int, prompt_id: str, choices: Sequence[int]) -> int:
    """nFrames gating: the overview size of one prompt, drawn uniformly from ``choices``.

    Seeded by ``(seed, prompt_id)`` through SHA-256 (stable across processes and Python versions),
    so every rollout of the prompt, every rank and a resumed run draw the same n.
    """
    if not choices:
        raise ValueError("nFrames gating needs at least one frame count")
    h = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big")).choice(list(choices))


class PromptCache:
    """Prepared initial states (decoded overview + planner messages), LRU, keyed by video, question and n."""

    def __init__(self, agent: Agent, capacity: int = 64):
        self.agent = agent
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(video: str, question: str, options: Sequence[str] | None, n: int | None) -> tuple:
        st = os.stat(video)
        return (os.path.realpath(video), st.st_size, st.st_mtime_ns, question, tuple(options or ()), n)

    def get(self, video: str, question: str, options: Sequence[str] | None, n: int | None):
        k = self.key(video, question, options, n)
        if k in self._items:
            self.hits += 1
            self._items.move_to_end(k)
            return self._items[k]
        self.misses += 1
        value = self.agent.initial_state(video, question, options, n_frames=n)
        self._items[k] = value
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value


@dataclass
class TokenSequence:
    """One trainable sequence: ids, which of them were sampled, their behaviour logprobs, its images."""

    role: str  # "planner" or "subagent"
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # behaviour logprobs on sampled positions, 0.0 elsewhere
    images: list = field(default_factory=list)
    turn: int = 0
    index: int | None = None

    @property
    def n_trained(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Episode:
    prompt_id: str
    sample: int  # index within the group
    n_frames: int | None
    answer: Answer
    text: str  # the transcript the reward scores (think prefix included)
    sequences: list[TokenSequence]
    reward: RewardBreakdown | None = None
    advantage: float = 0.0
    seconds: float = 0.0

    @property
    def tool_calls(self) -> int:
        return self.answer.trace.tool_calls


def episode_transcript(answer: Answer) -> str:
    """Planner responses (prefix included) interleaved with the tool-response turns that followed them."""
    responses, tools, seen_assistant = [], [], False
    for m in answer.messages or []:
        if m["role"] == "assistant":
            responses.append(m["content"])
            seen_assistant = True
        elif m["role"] == "user" and seen_assistant:
            tools.append(text_of(m["content"]))
    return transcript(responses, tools)


def assemble(answer: Answer, eos_id: int, subagents: bool = True) -> list[TokenSequence]:
    """Token sequences of one episode (see the module docstring). Raises :class:`RolloutError` when the
    backend gave no token ids, or when an earlier turn's sampled ids are not found verbatim in the
    final prompt (the model's output was re-tokenised)."""
    gens = answer.generations or []
    planner = sorted(((turn, g) for role, turn, _, g in gens if role == "planner"), key=lambda x: x[0])
    if not planner:
        raise RolloutError("the episode has no planner generation")
    for _, g in planner:
        if g.prompt_ids is None or g.output_ids is None or g.logprobs is None:
            raise RolloutError("the policy returned no token ids / logprobs; use the local or sglang backend")
    final = planner[-1][1]
    ids = continued_ids(final, eos_id)
    mask, lps = [0] * len(ids), [0.0] * len(ids)
    for turn, g in planner:
        start = len(g.prompt_ids) + len(g.prefix_ids or [])
        out = g.output_ids
        if ids[start : start + len(out)] != out:
            raise RolloutError(f"planner turn {turn}: its sampled ids are not in the final prompt verbatim "
                               "(the chat template re-renders earlier turns); training would score other tokens")
        if len(g.logprobs) != len(out):
            raise RolloutError(f"planner turn {turn}: {len(out)} ids but {len(g.logprobs)} logprobs")
        mask[start : start + len(out)] = [1] * len(out)
        lps[start : start + len(out)] = g.logprobs
    seqs = [TokenSequence("planner", ids, mask, lps, final.extra.get("images", []),
                          turn=planner[-1][0])]
    if subagents:
        for role, turn, index, g in gens:
            if role != "subagent" or not g.output_ids:
                continue
            if g.prompt_ids is None or g.logprobs is None:
                raise RolloutError("a sub-agent generation has no token ids / logprobs")
            head = [*g.prompt_ids, *(g.prefix_ids or [])]
            ids = head + list(g.output_ids)
            seqs.append(TokenSequence(
                "subagent", ids, [0] * len(head) + [1] * len(g.output_ids), [0.0] * len(head) + list(g.logprobs),
                g.extra.get("images", []), turn=turn, index=index,
            ))
    return seqs


async def run_group(
    agent: Agent,
    cache: PromptCache,
    prompt_id: str,
    video: str,
    question: str,
    options: Sequence[str] | None,
    answer,
    task: str,
    group: int,
    n_frames: int | None,
    eos_id: int,
    reward_cfg: RewardConfig,
    seed: int = 0,
    subagents: bool = True,
    judge=None,
) -> list[Episode]:
    """G concurrent rollouts of one prompt, assembled and scored."""
    state, trace = await asyncio.to_thread(cache.get, video, question, options, n_frames)

    async def one(i: int) -> Episode:
        t0 = time.perf_counter()
        rollout_seed = int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}:{i}".encode()).digest()[:4], "big")
        ans = await agent.arun_state(state, trace, seed=rollout_seed)
        text = episode_transcript(ans)
        ep = Episode(prompt_id, i, n_frames, ans, text, assemble(ans, eos_id, subagents))
        ep.reward = score(text, answer, task, options, reward_cfg, judge=judge, question=question)
        ep.seconds = time.perf_counter() - t0
        return ep

    return list(await asyncio.gather(*(one(i) for i in range(group))))
