"""Rollouts for PARA-GRPO, produced by the same ``paravt_agent`` graph that serves users.

One prompt (video, question, answer) → G episodes run concurrently through
:meth:`paravt_agent.Agent.arun` from ONE prepared :class:`~paravt_agent.types.RolloutInput`
(the overview is decoded once per prompt and n). Every model call of an episode
comes back as a :class:`~paravt_agent.types.GenerationRecord` with token ids and
logprobs; an episode becomes token sequences:

* the planner: the final turn's prompt ids + think prefix + sampled ids. Earlier
  turns are inside that prompt *as their exact sampled ids* (the policy continues
  from ids, never re-tokenising model output), the K sub-agent summaries sit in it
  once per tool turn as ONE ``<tool_response>`` user turn. ``loss_mask`` is 1 on
  sampled tokens only: the system prompt, frames, tool responses and the pinned
  ``<think>\\n`` prefix are context (the reward still sees the prefix: it scores
  the transcript, prefix included). When a turn's prompt does not hold the earlier
  turns verbatim (a server that re-tokenises, a template that re-renders), each
  planner turn becomes its own sequence, scored against the prompt it really had;
* each sub-agent: its prompt ids + sampled summary ids (optional, sharing the
  episode's advantage).

nFrames gating draws the overview size n per prompt from a generator seeded by
``(seed, prompt id)``: all G rollouts of the prompt see the same n frames (never
denser than the 1 fps grid), and the draw is the same on every rank and after a
restart. The prompt cache is keyed by the video's identity (path, size, mtime),
the question, the options and n, and is safe under concurrent use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from paravt_agent.agent import Agent
from paravt_agent.errors import ParaVTError
from paravt_agent.policy.base import images_of
from paravt_agent.policy.chat import continued_ids
from paravt_agent.types import Answer, RolloutInput
from paravt_agent.video import file_identity
from paravt_train.data.records import PromptItem, episode_transcript
from paravt_train.rewards import RewardBreakdown, RewardConfig, score
from paravt_train.rewards.multi_agent import SYNTHESIZER, agent_reward, agent_transcript, team_role

__all__ = [
    "Episode",
    "PromptCache",
    "agent_episodes",
    "agent_of",
    "assemble_agents",
    "RolloutError",
    "RolloutSettings",
    "TokenSequence",
    "assemble",
    "gate_frames",
    "policy_versions",
    "record_sequence",
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


def _frame_bytes(inp: RolloutInput) -> int:
    return sum(im.nbytes for im in images_of(inp.messages))


class PromptCache:
    """Prepared :class:`RolloutInput` s (decoded overview + planner messages), LRU, keyed by the video's
    identity, the question, the options and n, bounded by entries and by the bytes of their frames.
    Thread-safe; concurrent requests for one key prepare once."""

    def __init__(self, agent: Agent, capacity: int = 64, max_bytes: int = 1 << 30):
        self.agent = agent
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[tuple, threading.Event] = {}
        self.hits = self.misses = 0

    @staticmethod
    def key(video: str, question: str, options: Sequence[str] | None, n: int | None) -> tuple:
        return (*file_identity(video), question, tuple(options or ()), n)

    def get(self, video: str, question: str, options: Sequence[str] | None, n: int | None) -> RolloutInput:
        k = self.key(video, question, options, n)
        while True:
            with self._lock:
                if k in self._items:
                    self.hits += 1
                    self._items.move_to_end(k)
                    return self._items[k][0]
                wait = self._pending.get(k)
                if wait is None:
                    self._pending[k] = threading.Event()
                    self.misses += 1
                    break
            wait.wait()
        try:
            value = self.agent.prepare(video, question, options, n_frames=n)
            size = _frame_bytes(value)
            with self._lock:
                self._items[k] = (value, size)
                self.bytes += size
                while len(self._items) > 1 and (len(self._items) > self.capacity or self.bytes > self.max_bytes):
                    _, (_, gone) = self._items.popitem(last=False)
                    self.bytes -= gone
        finally:
            with self._lock:
                self._pending.pop(k).set()
        return value


@dataclass(kw_only=True)  # built by keyword (tests/test_architecture.py)
class TokenSequence:
    """One trainable sequence: ids, which of them were sampled, their behaviour logprobs, its images, and
    the episode (rollout) it belongs to."""

    role: str  # "planner", "subagent", "tool:<name>" or "agent:<name>"
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # behaviour logprobs on sampled positions, 0.0 elsewhere
    images: list = field(default_factory=list)
    turn: int = 0
    index: int | None = None
    episode: str = ""
    image_grid_thw: list | None = None

    @property
    def n_trained(self) -> int:
        return sum(self.loss_mask)


@dataclass(kw_only=True)  # built by name, never by position
class Episode:
    prompt_id: str
    task: str
    sample: int  # index within the group
    n_frames: int | None
    answer: Answer | None
    text: str  # the transcript the reward scores (think prefix included)
    sequences: list[TokenSequence]
    reward: RewardBreakdown | None = None
    advantage: float = 0.0
    seconds: float = 0.0
    failed: str | None = None  # why the graph did not finish the episode (its error), None when it did
    subagent_errors: int = 0
    retokenized_turns: int = 0
    round_trip_turns: int = 0  # model calls whose prompt ids were emulated (a server that reports none)
    versions: list[int] = field(default_factory=list)  # policy versions that sampled its tokens (server-reported)
    tag: str = ""  # where it was rolled out (step, rank, sampling round): ids stay unique across them
    #: multi-agent RL (the collaborative mode's cpp protocol): the collaborating agent whose turns these are, or the
    #: team's role (``synthesizer``, ``summary``; ``team`` for a rollout that raised); each gets its own group
    #: advantage
    agent: str | None = None

    @property
    def id(self) -> str:
        return (f"{self.prompt_id}#{self.sample}" + (f".{self.agent}" if self.agent else "")
                + (f"@{self.tag}" if self.tag else ""))

    @property
    def tool_calls(self) -> int:
        return self.answer.trace.tool_calls if self.answer is not None else 0


@dataclass
class RolloutSettings:
    """How a group is rolled out and scored."""

    group: int = 8
    n_frames: int | None = None
    reward: RewardConfig = field(default_factory=RewardConfig)
    seed: int = 0
    subagents: bool = True
    tool_models: bool = True  # model-backed tools' calls to the policy enter the loss (False: frozen)
    judge: object | None = None
    tag: str = ""  # names the episodes' origin in their ids (the trainer: step, rank and sampling round)
    #: multi-agent RL with several policies: the agents whose calls this rollout trains whatever model made them
    #: (:mod:`paravt_train.rl.marl`); None: the trained policy's calls only
    agent_policies: list[str] | None = None
    #: the tokens the trainer scores as banned (its tokenizer's vision placeholders): an episode that sampled one
    #: fails, whether or not the backend bans them itself (a plugin backend may not)
    banned: tuple[int, ...] = ()


def sampled_any(answer: Answer, ids: Sequence[int]) -> bool:
    """Whether some turn of the episode sampled one of ``ids`` (e.g. a vision placeholder, which the
    trainer would read as an image position: such an episode cannot be trained on)."""
    bad = set(ids)
    return bool(bad) and any(bad.intersection(r.generation.output_ids or []) for r in answer.records if r.trainable)


def assemble(answer: Answer, eos_id: int, subagents: bool = True, episode: str = "",
             tool_models: bool = True) -> tuple[list[TokenSequence], int]:
    """Token sequences of one episode (see the module docstring) and the number of planner turns whose
    prompt did not hold the earlier turns verbatim. Besides the planner's: the sub-agents' (``subagents``), the
    model-backed tools' calls (``tool:<name>``; ``tool_models``) and the collaborating agents' turns
    (``agent:<name>``), each only where the policy being trained made it (``trainable``). Raises
    :class:`RolloutError` when the backend gave no token ids."""
    planner = answer.planner_records()
    if not planner:
        raise RolloutError("the episode has no planner generation")
    for r in planner:
        if not r.generation.has_tokens:
            raise RolloutError("the policy returned no token ids / logprobs; use the local or sglang backend")
    final = planner[-1].generation
    ids = continued_ids(final, eos_id)
    spans, split = [], 0
    for r in planner:
        g = r.generation
        start = len(g.prompt_ids) + len(g.prefix_ids or [])
        if len(g.logprobs) != len(g.output_ids):
            raise RolloutError(f"planner turn {r.turn}: {len(g.output_ids)} ids but {len(g.logprobs)} logprobs")
        if g.retokenized or ids[start : start + len(g.output_ids)] != g.output_ids:
            split += 1
        spans.append((start, g))
    seqs: list[TokenSequence] = []
    if split == 0:
        mask, lps = [0] * len(ids), [0.0] * len(ids)
        for start, g in spans:
            mask[start : start + len(g.output_ids)] = [1] * len(g.output_ids)
            lps[start : start + len(g.output_ids)] = g.logprobs
        seqs.append(TokenSequence(role="planner", input_ids=ids, loss_mask=mask, logprobs=lps,
                                  images=planner[-1].images, turn=planner[-1].turn,
                                  episode=episode, image_grid_thw=final.image_grid_thw))
    else:  # each turn against the prompt it really had
        for r in planner:
            g = r.generation
            head = [*g.prompt_ids, *(g.prefix_ids or [])]
            seqs.append(TokenSequence(role="planner", input_ids=head + list(g.output_ids),
                                      loss_mask=[0] * len(head) + [1] * len(g.output_ids),
                                      logprobs=[0.0] * len(head) + list(g.logprobs), images=r.images, turn=r.turn,
                                      episode=episode, image_grid_thw=g.image_grid_thw))
    others = [r for r in answer.records if r.role != "planner" and r.trainable and (
        subagents if r.role == "subagent" else tool_models if r.role.startswith("tool:") else True)]
    seqs += [s for s in (record_sequence(r, episode) for r in others) if s is not None]
    return seqs, split


def record_sequence(r, episode: str) -> TokenSequence | None:
    """One model call as its own sequence: its prompt ids (and pinned prefix) as context, its sampled ids trained
    (None for an empty output)."""
    g = r.generation
    if not g.output_ids:
        return None
    if not g.has_tokens:
        raise RolloutError(f"a {r.role} generation has no token ids / logprobs")
    head = [*g.prompt_ids, *(g.prefix_ids or [])]
    return TokenSequence(role=r.role, input_ids=head + list(g.output_ids),
                         loss_mask=[0] * len(head) + [1] * len(g.output_ids),
                         logprobs=[0.0] * len(head) + list(g.logprobs), images=r.images, turn=r.turn, index=r.index,
                         episode=episode, image_grid_thw=g.image_grid_thw)


def agent_of(r, pool: Sequence[str]) -> str:
    """Whose call a record of the collaborative mode's cpp protocol is: ``agent:<name>`` records and their tool
    calls' records (a crop's summary, a model-backed tool's calls: index = the agent's place in the pool) belong to
    that agent; the reason summary / synthesizer (``planner``) to the team."""
    if r.role.startswith("agent:"):
        return r.role.split(":", 1)[1]
    if r.role != "planner" and r.index is not None and 0 <= r.index < len(pool):
        return pool[r.index]
    return "team"


def assemble_agents(answer: Answer, pool: Sequence[str], episode: str, subagents: bool = True,
                    tool_models: bool = True, policies: Sequence[str] | None = None) -> dict[str, list[TokenSequence]]:
    """Multi-agent RL: each collaborating agent's token sequences (``{name: [...], "team": [...]}``), one per
    model call, ``episode`` suffixed with the agent's name. Calls of the trained policy only (``trainable``), or,
    with ``policies``, the calls of the agents named there whatever model made them (a trainer of that model)."""
    out: dict[str, list[TokenSequence]] = {n: [] for n in [*pool, "team"]}
    for r in answer.records:
        who = agent_of(r, pool)
        mine = r.trainable if policies is None else who in policies
        wanted = subagents if r.role == "subagent" else tool_models if r.role.startswith("tool:") else True
        if mine and wanted:
            seq = record_sequence(r, f"{episode}.{who}")
            if seq is not None:
                out[who].append(seq)
    return out


async def run_group(agent: Agent, cache: PromptCache, prompt: PromptItem, settings: RolloutSettings,
                    eos_id: int) -> list[Episode]:
    """G concurrent rollouts of one prompt, assembled and scored. An episode whose graph raised is kept
    with ``failed`` set (no sequences); the trainer counts it and drops or keeps it by its config."""
    try:
        inp = await asyncio.to_thread(cache.get, prompt.video, prompt.question, prompt.options, settings.n_frames)
    except Exception as exc:  # an unreadable video: the whole group fails, counted, and the run goes on
        why = f"unreadable video {prompt.video}: {exc.__class__.__name__}: {exc}"
        failed = RewardBreakdown(total=settings.reward.min_total, acc=0.0, fmt=0.0, base=0.0, anchor=0.0,
                                 tool=0.0)
        return [Episode(prompt_id=prompt.id, task=prompt.task, sample=i, n_frames=settings.n_frames, answer=None,
                        text="", sequences=[], failed=why, tag=settings.tag, reward=failed)
                for i in range(settings.group)]
    banned = tuple(sorted(set(agent.policy.placeholder_ids) | set(settings.banned)))

    async def one(i: int) -> list[Episode]:
        t0 = time.perf_counter()
        rollout_seed = int.from_bytes(hashlib.sha256(f"{settings.seed}:{prompt.id}:{i}".encode()).digest()[:4], "big")
        ep = Episode(prompt_id=prompt.id, task=prompt.task, sample=i, n_frames=settings.n_frames, answer=None,
                     text="", sequences=[], tag=settings.tag)
        cpp = agent.config.mode == "collaborative" and agent.config.collab.protocol == "cpp"
        try:
            ans = await agent.arun(inp, seed=rollout_seed)
        except Exception as exc:  # the graph raised before any planner turn: nothing to train on
            ep.failed = f"{exc.__class__.__name__}: {exc}"
            ep.agent = "team" if cpp else None  # multi-agent RL: nothing to train, its role unknown
            ep.reward = RewardBreakdown(total=settings.reward.min_total, acc=0.0, fmt=0.0, base=0.0, anchor=0.0,
                                        tool=0.0)
            ep.seconds = time.perf_counter() - t0
            return [ep]
        ep.answer = ans
        ep.text = episode_transcript(ans)
        # an empty or degenerate answer is the model's: scored; a run error or a tool slot the runtime could not
        # fill (an endpoint down, a timeout) is not: the episode is counted as failed, never scored as the policy's
        ep.failed = "; ".join(dict.fromkeys([*ans.trace.run_errors, *ans.trace.runtime_call_errors])) or None
        ep.subagent_errors = sum(1 for t in ans.trace.turns for c in t.calls if c.error)
        ep.round_trip_turns = sum(r.generation.prompt_source == "round_trip" for r in ans.records)
        ep.versions = policy_versions(ans)
        if sampled_any(ans, banned):  # a server sampled a vision placeholder: counted as failed, not trained on
            ep.failed = "a turn sampled a vision placeholder token"
        elif not cpp:
            ep.sequences, ep.retokenized_turns = assemble(ans, eos_id, settings.subagents, ep.id,
                                                          settings.tool_models)
        worked = sum(1 for c in ans.trace.all_calls() if not c.error)
        ep.reward = await asyncio.to_thread(score, ep.text, prompt.answer, prompt.task, prompt.options,
                                            settings.reward, settings.judge, prompt.question, ans.trace.response,
                                            worked)
        ep.seconds = time.perf_counter() - t0
        return agent_episodes(ep, agent.config.collab, prompt, settings) if cpp else [ep]

    return [e for eps in await asyncio.gather(*(one(i) for i in range(settings.group))) for e in eps]


def agent_episodes(team: Episode, collab, prompt: PromptItem, settings: RolloutSettings) -> list[Episode]:
    """Multi-agent RL (the collaborative mode's cpp protocol): one episode per collaborating agent, its own calls as
    sequences and its own reward (:func:`~paravt_train.rewards.multi_agent.agent_reward`: R_res + R_format + R_col +
    R_tool), and the team's, scored as usual, under its role (:func:`~paravt_train.rewards.multi_agent.team_role`):

    * ``synthesizer`` (no consensus): its answer is the team's, so its calls train with the team's reward,
      normalised over the group's synthesizer episodes only (the rollouts without a consensus, the harder ones);
    * ``summary`` (a consensus): the vote is the answer and the reason summary's words do not change the reward, so
      its calls are recorded and never trained (the episode stays for the step's metrics).

    The trainer normalises each agent's and role's rewards over the group's rollouts apart
    (:func:`~paravt_train.rl.objective.episode_advantages`)."""
    ans = team.answer
    pool = [a.name for a in collab.agents]
    seqs = (assemble_agents(ans, pool, team.id, settings.subagents, settings.tool_models, settings.agent_policies)
            if team.failed is None else {n: [] for n in [*pool, "team"]})
    team.agent = team_role(ans)
    team.sequences = seqs["team"] if team.agent == SYNTHESIZER else []
    buffers = ans.trace.memory_buffer()
    final_acc = team.reward.acc
    out = []
    for name in pool:
        entries = buffers.get(name, [])
        r = agent_reward(entries, ans.trace.answer, final_acc, prompt.answer, prompt.task, prompt.options,
                         settings.reward, settings.judge, prompt.question)
        out.append(dataclasses.replace(team, agent=name, text=agent_transcript(entries), reward=r,
                                       sequences=seqs[name]))
    return [*out, team]


def policy_versions(answer: Answer) -> list[int]:
    """The policy versions that sampled an episode's tokens, as the server reported them (SGLang's
    ``weight_version``, and ``weight_versions`` spans for a request an update interrupted): the trainer's steps
    (``"default"``: the initial weights, 0). Several versions: a partial rollout. Empty: a backend that reports
    none (the local backend samples with the trained model itself)."""
    found: set[int] = set()
    for r in answer.records:
        if not r.trainable:  # another model's versions are not the trained policy's
            continue
        g = r.generation
        for v in [v for v, _, _ in g.weight_versions] or ([g.weight_version] if g.weight_version else []):
            if v == "default":
                found.add(0)
            elif str(v).isdigit():
                found.add(int(v))
    return sorted(found)
