"""The toy world: its videos, its questions' evidence design, its traces and the build pipeline."""

import re

import numpy as np
import pandas as pd
import pytest

from paravt_agent.agent import Agent
from paravt_agent.errors import ConfigError
from paravt_agent.policy.base import Generation, Policy, text_of
from paravt_agent.protocol import extract_answer, parse_tool_calls, split_think
from paravt_agent.video import VideoReader
from paravt_train.data import SFTSample, render_messages
from paravt_train.sft import build_example
from paravt_train.toy.build import toy_agent_config
from paravt_train.toy.quickstart import shortcut
from paravt_train.toy.rows import copy_rows, corpus, sft_rows, subagent_sample
from paravt_train.toy.world import (
    COLOURS,
    answer_turn,
    direct_trace,
    make_world,
    make_worlds,
    parallel_trace,
    planner_turn,
    segment_lengths,
    sequential_trace,
    windows_for,
)
from tools import ToolRegistry

COPY_STEPS = 800  # the test-size model starts copying between steps 400 and 800 at seed 0

SCHEMA = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()


def nearest_colour(rgb):
    return min(COLOURS, key=lambda c: np.abs(np.array(COLOURS[c]) - rgb).sum())


@pytest.mark.parametrize("seed", range(20))
def test_world_timeline(seed):
    w = make_world(seed, mcq=3, oe=2, tvg=2)
    assert w.duration in (64, 80, 96, 112, 128)
    assert w.segments[0][1] == 0 and w.segments[-1][2] == w.duration
    lo, hi = segment_lengths(w.duration)
    for (c1, _, b1), (c2, a2, _) in zip(w.segments, w.segments[1:], strict=False):
        assert b1 == a2 and c1 != c2
    # every segment is longer than the spacing of a 64-frame overview, the last may absorb a short tail
    assert all(lo <= b - a <= hi for _, a, b in w.segments[:-1]) and w.segments[-1][2] - w.segments[-1][1] >= lo
    from paravt_agent.video import overview_times

    dense = overview_times(float(w.duration), n=64)  # a 64-frame overview sees every segment
    assert all(any(a <= t < b for t in dense) for _, a, b in w.segments)
    for u in w.uniques:
        assert [c for c, _, _ in w.segments].count(u) == 1
    assert [q.task for q in w.questions] == ["mcq"] * 3 + ["oe"] * 2 + ["tvg"] * 2
    for q in w.questions:
        if q.task == "mcq":
            assert q.options["ABCD".index(q.answer)].endswith(w.colour_at(q.t))
        if q.task == "tvg":
            assert list(q.span) == list(w.span_of(q.colour))
    # a world's first questions do not depend on how many are asked
    assert make_world(seed).questions == [w.questions[0], w.questions[3], w.questions[5]]


def test_video_shows_the_timeline_and_the_trace_matches_the_frames(tmp_path):
    [w] = make_worlds([7], tmp_path, mcq=1, oe=1, tvg=2)
    r = VideoReader(w.video)
    assert r.info.duration == pytest.approx(w.duration, abs=0.01)
    ov = r.overview(max_pixels=1024)
    assert ov.frames.shape[1:3] == (32, 32) and len(ov) == 64
    for frame, t in zip(ov.frames, ov.timestamps, strict=True):
        assert nearest_colour(frame.reshape(-1, 3).mean(0)) == w.colour_at(t)
    # the summaries in a trace are exactly what the crop frames show
    for q in w.questions:
        msgs = parallel_trace(w, q, w.video, 8, SCHEMA)
        calls = parse_tool_calls(msgs[2]["content"])
        assert calls and all(c.ok for c in calls)
        for c in calls:
            a, b = c.arguments["start_time"], min(c.arguments["end_time"], w.duration)
            clip = r.crop(a, b, crop_fps=1.0, max_pixels=1024)
            frames = zip(clip.frames, clip.timestamps, strict=True)
            seen = [f"{nearest_colour(f.reshape(-1, 3).mean(0))} {round(t)}" for f, t in frames]
            if q.task == "tvg":  # a grounding sub-agent thinks: the asked colour, then what its frames show
                reply = w.summary(q, a, b)
                think, finding = reply.split("</think>\n", 1)
                head, listing = think.removeprefix("<think>\n").split(". ", 1)
                assert head == f"Looking for colour {q.colour}"
                assert f"colour {q.colour} " in q.question  # the words it copies, as the question has them
                # colour first, the asked colour's start marked "^" and the entry after it "$", on the second;
                # a run that reaches the window's end is closed by "$<the next second>"
                entries = listing.removesuffix(".").split("; ")
                on = [e.split()[0] == q.colour for e in seen]
                closed = on[-1]
                assert len(entries) == len(seen) + closed
                if closed:
                    assert entries[-1] == f"${int(seen[-1].split()[1]) + 1}"
                for i, e in enumerate(entries[: len(seen)]):
                    colour, second = seen[i].split()
                    if on[i] and (i == 0 or not on[i - 1]):
                        assert e == f"{colour} ^{second}"
                    elif not on[i] and i > 0 and on[i - 1]:
                        assert e == f"{colour} ${second}"
                    else:
                        assert e == seen[i]
                # its finding: the marked seconds ("Found: ^17 $19."), or "Nothing."
                assert w.report(q, a, b) == finding and msgs[3]["content"].count(finding) >= 1
                marked = {e.split()[-1][0]: int(e.split()[-1][1:]) for e in entries if e.split()[-1][0] in "^$"}
                if not any(on):
                    assert finding == "Nothing." and not marked
                else:
                    assert finding == f"Found: ^{marked['^']} ${marked['$']}."
            else:  # a colour-at-t sub-agent sees the frame of second t and reports it second first
                assert (a, b) == (q.t, q.t + 0.5) and w.summary(q, a, b) == f"{q.t} {q.colour}"
                assert seen == [f"{q.colour} {q.t}"]
        if q.task == "tvg":  # the scan tiles the video, last window first: every frame once, 16 per window
            seconds = [s for a, b in windows_for(w, q)[::-1] for s in w.seconds(a, b)]
            assert seconds == list(range(w.duration)) and all(len(w.seconds(a, b)) == 16 for a, b in windows_for(w, q))


def test_evidence_is_not_in_a_sparse_overview_but_is_in_a_dense_one():
    worlds = [make_world(s, mcq=2, tvg=2) for s in range(200)]
    base = shortcut(worlds, (4, 8, 64))
    assert base[8]["mcq"] < 0.55 and base[4]["mcq"] < 0.45  # reading the nearest frame is a weak shortcut
    assert base[64]["mcq"] > 0.85  # with 64 frames every segment is visible
    assert base[8]["tvg"] < 0.2 and base[64]["tvg"] > 0.7


def test_sft_rows_mix():
    worlds = [make_world(s, mcq=2, oe=1, tvg=2) for s in range(10)]
    for w in worlds:
        w.video = f"/v/{w.wid}.mp4"
    rows = sft_rows(worlds, SCHEMA, video_root="/v")
    kinds = {r["id"].rsplit("-", 1)[1][:3] for r in rows}
    assert kinds == {"par", "ans", "seq", "dir", "sub", "xsu"}
    assert sum(r["id"].endswith("-par") for r in rows) == 50
    # the answer-focused copy (every grounding question, half the colour-at-t ones): the planner turn is
    # context, only the answer is trained
    ans = [r for r in rows if r["id"].endswith("-ans")]
    assert sum("-tvg" in r["id"] for r in ans) == 20 and 20 < len(ans) < 50
    for r in ans:
        turns = [m for m in r["messages"] if m["role"] == "assistant"]
        assert [m.get("train", True) for m in turns] == [False, True] and "<answer>" in turns[-1]["content"]
    # no-tool traces: the short system prompt, one assistant turn that answers
    direct = [r for r in rows if r["id"].endswith("-dir")]
    assert len(direct) > 15 and all(len(r["messages"]) == 3 and "<tool_call>" not in r["messages"][-1]["content"]
                                    for r in direct)
    # sub-agent samples see the question: colour-at-t ones report the frame at t, grounding ones list the window
    subs = [r for r in rows if "-sub" in r["id"] or "-xsub" in r["id"]]
    for r in subs:
        asked = r["messages"][1]["content"][-1]["text"]
        report = r["messages"][-1]["content"]
        if "at second" in asked:  # second first (the answer step has t and copies the colour after it)
            assert all(e.split()[0].isdigit() and e.split()[1] in COLOURS for e in report.split("; "))
        else:  # a think: the asked colour as the question words it, then the marked listing; the finding
            colour = asked.split("segment of colour ")[1].split()[0]
            think, finding = split_think(report)
            head, listing = think.split(". ", 1)
            assert head == f"Looking for colour {colour}" and listing.endswith(".")
            entries = listing.rstrip(".").split("; ")
            assert all(e.split()[-1].lstrip("^$").isdigit()
                       and e.split()[0].lstrip("$").isdigit() == (len(e.split()) == 1)
                       for e in entries)
            assert all(e.split()[0] in COLOURS for e in entries if len(e.split()) == 2)
            runs = sum(e.split()[-1].startswith("^") for e in entries)
            assert runs <= 1  # a colour the window shows as two runs is never asked
            assert (finding == "\nNothing.") == (runs == 0)
    extra = [r for r in rows if "-xsub" in r["id"]]
    assert len(extra) == 40 and len({len(r["messages"][-1]["content"].split("; ")) for r in extra}) > 4
    grounding = [r["messages"][-1]["content"] for r in extra if r["messages"][-1]["content"].startswith("<think>")]
    assert len(grounding) == 20 and 5 <= sum("Nothing." in x for x in grounding) <= 15  # hits and misses
    # a grounding question's windows that show its colour are sampled four times
    assert any(r["id"].endswith("rrr") and "-tvg" in r["id"] for r in subs)
    assert not any(r["id"].endswith("rrrr") for r in subs)
    # the no-tool think has its own shape: the colour comes from an image, not from a tool response
    assert all(r["messages"][-1]["content"].startswith(("<think>\nframe ", "<think>\nframes at:")) for r in direct)
    assert not any(r["id"].startswith("copy") for r in rows)  # copy rows are added by the build, off by default


def test_copy_rows_repeat_arbitrary_tokens(tmp_path):
    from paravt_train.toy.tiny import build_tiny_model, copy_vocabulary

    model = build_tiny_model(tmp_path / "m", corpus(sft_rows([make_world(s) for s in range(4)], SCHEMA)),
                             size="test", vocab_size=600)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    vocab = copy_vocabulary(tok)
    assert len(vocab) > 100 and len(set(vocab)) == len(vocab)
    # no digits (the traces' numbers), no tag or JSON characters (a random sequence never opens a tag)
    assert not any(set(v) & set("0123456789<>|{}[]\"\\") for v in vocab) and all(v.strip() for v in vocab)
    rows = copy_rows(40, vocab, seed=3)
    assert rows == copy_rows(40, vocab, seed=3) and rows != copy_rows(40, vocab, seed=4)
    seqs = []
    for r in rows:
        user, reply = r["messages"]
        seq = user["content"].removeprefix("Repeat: ")
        assert reply["content"] == f"<think>\n{seq}</think>\n<answer>{seq.split()[-1]}</answer>"
        assert split_think(reply["content"])[0] and extract_answer(reply["content"]) == seq.split()[-1]
        seqs.append(tok(seq)["input_ids"])
    assert len({tuple(x) for x in seqs}) == 40 and all(8 <= len(x) <= 100 for x in seqs)
    # arbitrary tokens: the rows use much of the vocabulary, so a repeat cannot be guessed from word statistics
    assert len({t for x in seqs for t in x}) > 0.5 * len(vocab)
    # longer rows on request (the reach a copy has to have is the length it was trained on)
    long = [tok(r["messages"][0]["content"])["input_ids"] for r in copy_rows(5, vocab, length=(300, 320))]
    assert all(len(x) > 150 for x in long) and max(len(x) for x in long) > 2 * max(len(x) for x in seqs) - 40
    from paravt_agent.config import apply_overrides
    from paravt_train.toy.build import ToyConfig

    assert apply_overrides(ToyConfig(out="o"), ["copy_length=[200, 800]"]).copy_length == (200, 800)
    with pytest.raises(ConfigError, match="copy_length"):
        apply_overrides(ToyConfig(out="o"), ["copy_length=[80, 20]"])


def test_plans_copy_and_count_down_never_add():
    """Every number a plan writes is copied (t, the duration) or one of a fixed list: colour-at-t crops
    [t, t.5] (t's token, then ".5"), a grounding scan starts at the last window, which depends on the
    duration alone, and counts down to [0, 15], so every plan stops at the same call."""
    for seed in range(12):
        w = make_world(seed, mcq=1, oe=0, tvg=1)
        for q in w.questions:
            text = planner_turn(q, windows_for(w, q), w.duration)
            calls = [(c.arguments["start_time"], c.arguments["end_time"]) for c in parse_tool_calls(text)]
            if q.task == "tvg":
                assert text.startswith(f"<think>\nScan all {w.duration} seconds.</think>")
                assert calls == [(a, a + 15) for a in range(w.duration - 16, -1, -16)]
            else:
                assert text.startswith(f"<think>\nInspect around second {q.t}.</think>")
                assert calls == [(q.t, q.t + 0.5)] and f'"end_time": {q.t}.5' in text


def test_neighbours_plans_of_the_first_stage():
    """The recipe's first stage (``plans: neighbours``): colour-at-t crops the two one-second windows around
    t, whose sub-agents list two seconds each; grounding scans forward, so the answer step reads the findings
    in time order. Same answers, same sub-agent replies on a window, different plans; an unknown plan is an
    error."""
    for seed in range(12):
        w = make_world(seed, mcq=1, oe=1, tvg=1)
        for q in w.questions:
            wins = windows_for(w, q, "neighbours")
            calls = [(c.arguments["start_time"], c.arguments["end_time"])
                     for c in parse_tool_calls(planner_turn(q, wins, w.duration))]
            assert calls == wins
            ans = answer_turn(w, q, "neighbours")
            assert extract_answer(ans) == extract_answer(answer_turn(w, q))
            if q.task == "tvg":
                assert wins == windows_for(w, q)[::-1] and wins[0] == (0, 15)
                found = [w.report(q, a, b) for a, b in wins if w.report(q, a, b) != "Nothing."]
                assert ans.split("</think>")[0] == "<think>\nReports: " + " ".join(found)
            else:
                assert wins == [(q.t, q.t + 1), (q.t - 1, q.t)]
                assert [w.summary(q, a, b) for a, b in wins] == [
                    f"{q.t} {q.colour}; {q.t + 1} {w.colour_at(q.t + 1)}",
                    f"{q.t - 1} {w.colour_at(q.t - 1)}; {q.t} {q.colour}"]
    par = parallel_trace(w, q, w.video, 8, SCHEMA, "neighbours")
    assert parse_tool_calls(par[2]["content"]) and par[4]["content"] == answer_turn(w, q, "neighbours")
    with pytest.raises(ValueError, match="plans must be one of copy, neighbours"):
        windows_for(w, q, "forward")


def test_grounding_answer_covers_the_segment():
    """Copying the findings gives the segment: the last finding's "^" second and the first one's "$" second
    (the calls go from the video's end to its start)."""
    two = 0
    for seed in range(60):
        w = make_world(seed, mcq=0, oe=0, tvg=2)
        for q in w.questions:
            text = answer_turn(w, q)
            assert text.endswith(f"<answer>[{q.span[0]}, {q.span[1]}]</answer>")
            body = text.split("\n", 1)[1].split("</think>")[0]
            findings = [w.report(q, a, b) for a, b in windows_for(w, q)]
            found = [f for f in findings if f != "Nothing."]
            assert 1 <= len(found) <= 2 and body == "Reports: " + " ".join(found)  # verbatim, in call order
            assert all(f.startswith("Found: ^") for f in found) and not any("Found" in f for f in findings
                                                                            if f not in found)
            numbers = [[int(x[1:]) for x in f.rstrip(".").split()[1:]] for f in found]
            if len(found) == 2:  # the segment crosses a window's end: the two findings are neighbours
                i = findings.index(found[0])
                assert findings[i + 1] == found[1]
                assert numbers[1][1] == numbers[0][0] == w.duration - (i + 1) * 16
                two += 1
            assert numbers[-1][0] == q.span[0] and numbers[0][1] == q.span[1]
            # the planner reads only the findings: the listings stay in the sub-agents' thinks
            tool = parallel_trace(w, q, w.video, 8, SCHEMA)[3]["content"]
            text_of_tool = tool if isinstance(tool, str) else text_of(tool)
            assert "Looking for" not in text_of_tool and q.colour not in text_of_tool.split("</tool_response>")[0]
    assert 0 < two < 30  # a segment crosses a window's end in about one question in eight


def test_number_tokens_make_every_time_one_token_wherever_it_is_written(tmp_path):
    """ToyConfig.number_tokens: every whole number 0-255 is one token, longest first ("127", not "12" + "7"),
    the same token in a frame label ("<17.0 seconds>"), the question, a plan, a listing, a finding and an
    answer, so each copy of a time is a one-token lookup; text round-trips; without it numbers are digits."""
    from transformers import AutoTokenizer

    from paravt_agent.prompts import frame_parts
    from paravt_train.toy.tiny import build_tiny_model, copy_vocabulary

    text_corpus = corpus(sft_rows([make_world(s) for s in range(4)], SCHEMA))
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m", text_corpus, size="test", vocab_size=600,
                                                         number_tokens=True))
    plain = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "p", text_corpus, size="test", vocab_size=600))

    def pieces(t, k=tok):
        ids = k(t, add_special_tokens=False)["input_ids"]
        assert k.decode(ids) == t
        return [k.decode([i]) for i in ids]

    w = make_world(5, mcq=1, oe=0, tvg=1)
    checked = set()
    for q in w.questions:
        for msgs in (parallel_trace(w, q, "v.mp4", 8, SCHEMA), direct_trace(w, q, "v.mp4", 8)):
            for m in msgs:
                text = m["content"] if isinstance(m["content"], str) else text_of(m["content"])
                numbers = {n for n in re.findall(r"\d+", text) if int(n) < 256 and (n == "0" or n[0] != "0")}
                assert numbers <= {p for p in pieces(text) if p.isdigit()}
                checked |= numbers
    assert len(checked) > 10 and str(w.questions[0].t) in checked
    label = frame_parts(np.zeros((1, 4, 4, 3), np.uint8), [17.0])[0]["text"]
    assert label == "<17.0 seconds>" and "17" in pieces(label)
    assert {"17", "19"} <= set(pieces("red ^17; cyan $19. Found: ^17 $19. [17, 19]"))
    assert pieces("127 12 0") == ["127", " ", "12", " ", "0"] and pieces("1270") == ["127", "0"]
    assert pieces(" 127", plain) == [" ", "1", "2", "7"]
    # copy rows and the copy warm-up then draw number tokens too: copying a time is the lookup they teach
    assert "17" in copy_vocabulary(tok) and "17" not in copy_vocabulary(plain)


class Replay(Policy):
    """Answers with a trace's own turns and records every request the graph makes."""

    def __init__(self, planner_turns, summaries):
        self.planner_turns, self.summaries, self.calls = list(planner_turns), summaries, []

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        self.calls.append((role, messages))
        if role == "planner":
            return Generation(text=self.planner_turns.pop(0))
        head = text_of(messages[1]["content"])  # "Window a-b seconds, ..."
        a = float(head.split()[1].split("-")[0])
        return Generation(text=self.summaries[a])


def _ids(messages, video_root, processor):
    sample = SFTSample.model_validate({"messages": messages})
    ex = build_example(render_messages(sample.messages, video_root, toy_agent_config().frames), processor)
    return ex["input_ids"], ex.get("pixel_values")


@pytest.mark.parametrize("mode", ["parallel", "sequential", "none"])
def test_training_traces_are_what_the_agent_sends(tmp_path, tiny_model, mode):
    """Train/serve parity: an SFT trace renders to exactly the tokens and pixels the agent sends the
    policy when it runs the same turns (planner, the one <tool_response> turn, sub-agents)."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    [w] = make_worlds([3], tmp_path, mcq=1, oe=0, tvg=1)
    for q in w.questions:
        wins = windows_for(w, q)
        n = 8
        if mode == "parallel":
            trace = parallel_trace(w, q, w.video, n, SCHEMA)
            turns = [planner_turn(q, wins, w.duration), answer_turn(w, q)]
        elif mode == "sequential":
            trace = sequential_trace(w, q, w.video, n, SCHEMA)
            turns = [planner_turn(q, [x], w.duration) for x in wins] + [answer_turn(w, q)]
        else:
            trace = direct_trace(w, q, w.video, n)
            turns = [trace[-1]["content"]]
        policy = Replay(turns, {float(a): w.summary(q, a, b) for a, b in wins})
        agent = Agent(policy=policy, config=toy_agent_config(mode=mode))
        ans = agent.answer(w.video, q.question, q.options, n_frames=n)
        assert ans.trace.response == turns[-1]
        want_ids, want_pix = _ids(trace, None, proc)
        got = build_example(ans.messages, proc)
        assert got["input_ids"] == want_ids
        assert (got.get("pixel_values") is None) == (want_pix is None)
        if want_pix is not None:
            assert got["pixel_values"].equal(want_pix)
        subs = [m for role, m in policy.calls if role == "subagent"]
        assert len(subs) == (len(wins) if mode != "none" else 0)
        for msgs in subs:
            a = float(text_of(msgs[1]["content"]).split()[1].split("-")[0])
            b = next(y for x, y in wins if x == a)
            sub_ids, sub_pix = _ids(subagent_sample(w, q, w.video, (int(a), b)), None, proc)
            got = build_example([*msgs, {"role": "assistant", "content": w.summary(q, a, b)}], proc)
            assert got["input_ids"] == sub_ids and got["pixel_values"].equal(sub_pix)


def test_build_is_cached_and_quickstart_runs(tmp_path):
    from paravt_train.toy.build import ToyConfig, build
    from paravt_train.toy.quickstart import run

    cfg = ToyConfig(out=str(tmp_path / "toy"), train_worlds=4, test_worlds=1, steps=2, size="test", vocab_size=600,
                    batch_size=4, copy_steps=2, copy_rows=2, then=[])
    assert cfg.plans == "neighbours" and [(s.steps, s.lr, s.plans) for s in ToyConfig(out="o").then] == [
        (500, 5e-4, "copy"), (400, 5e-4, "copy")]  # the default recipe: neighbours, then two stages of copy plans
    warm_default = ToyConfig(out="o", init="p")  # a warm start: one stage on the shipped plans unless told
    assert (warm_default.plans, warm_default.then) == ("copy", [])
    assert ToyConfig(out="o", init="p", plans="neighbours", then=[{"steps": 1, "lr": 1.0}]).plans == "neighbours"
    logs = []
    model = build(cfg, progress=False, log=logs.append)
    assert sum(m.startswith("copy warm-up: 2 steps") for m in logs) == 1  # a fresh model is warmed up first
    data = pd.read_parquet(tmp_path / "toy" / "data" / "sft_train_neighbours.parquet")
    assert data["id"].str.startswith("copy").sum() == 8  # 2 copy rows per training video, in the mix
    assert not (tmp_path / "toy" / "data" / "sft_train.parquet").exists()  # no stage trains on the copy plans
    assert (model / "config.json").is_file() and (model / "agent_config.yaml").is_file()
    assert build(cfg, progress=False, log=logs.append) == model and "already built" in logs[-1]
    from safetensors.torch import load_file

    # the same settings elsewhere build the same policy, bit for bit (checkpoints/toy/COMMAND.txt relies on it)
    twin = build(cfg.model_copy(update={"out": str(tmp_path / "twin")}), progress=False, log=lambda m: None)
    a, t = load_file(model / "model.safetensors"), load_file(twin / "model.safetensors")
    assert a.keys() == t.keys() and all(a[k].equal(t[k]) for k in a)
    assert (twin / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    out = run(model, out=tmp_path / "qs", worlds=1, modes=("parallel", "none"), ns=(8,), progress=False,
              log=logs.append)
    assert set(out["results"]) == {("parallel", 8), ("none", 8)}
    assert out["results"][("none", 8)]["calls"] == 0
    assert "| parallel | 8 |" in out["table"] and "nearest-frame shortcut" in out["table"]
    assert any("one full trace" in m for m in logs)
    # a warm start fine-tunes the given policy (its tokenizer, its weights) instead of a fresh tiny model
    warm = ToyConfig(out=str(tmp_path / "warm"), train_worlds=4, test_worlds=1, steps=1, batch_size=4, lr=1e-9,
                     init=str(model), then=[])
    assert warm.digest() != cfg.digest()
    model2 = build(warm, progress=False, log=logs.append)
    assert any(m.startswith("warm start from") for m in logs) and not (tmp_path / "warm" / "init").exists()
    assert sum(m.startswith("copy warm-up") for m in logs) == 1  # not for a warm start
    assert (model2 / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    b = load_file(model2 / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-4 for k in a)  # lr 1e-9: the same weights
    with pytest.raises(ConfigError, match="not a model directory"):
        build(warm.model_copy(update={"init": str(tmp_path)}), progress=False)
    # stages in one build (`then`) train exactly as the separate warm-start runs they stand for, each on its
    # own plans' traces (the default recipe: neighbours first, then copy)
    staged = build(ToyConfig.model_validate({**cfg.model_dump(), "out": str(tmp_path / "staged"),
                                             "then": [{"steps": 2, "lr": 1e-3}]}), progress=False, log=logs.append)
    assert any(m.startswith("stage 2: 2 steps at lr 0.001 on the copy plans") for m in logs)
    on_copy = pd.read_parquet(tmp_path / "staged" / "data" / "sft_train.parquet")
    assert len(on_copy) < len(data)  # one colour-at-t window per question instead of two: fewer sub-agent rows
    apart = build(ToyConfig(out=str(tmp_path / "apart"), train_worlds=4, test_worlds=1, steps=2, batch_size=4,
                            lr=1e-3, copy_rows=2, init=str(model), plans="copy", then=[]), progress=False)
    c, d = load_file(staged / "model.safetensors"), load_file(apart / "model.safetensors")
    assert any((c[k] - a[k]).abs().max() > 1e-4 for k in a)  # the stage trained
    assert all((c[k] - d[k]).abs().max() == 0 for k in c)


def test_copy_warmup_teaches_a_fresh_model_to_copy(tmp_path):
    """The stand-in for pretraining: after the warm-up a fresh tiny model continues a repeated random
    sequence by copying (an induction head), which it cannot do before; its weights are saved in place."""
    from safetensors.torch import load_file

    from paravt_train.toy.tiny import build_tiny_model, copy_warmup

    model = build_tiny_model(tmp_path / "m", ["red green blue 12 13"] * 4, size="test")
    before = load_file(model / "model.safetensors")
    logs = []
    out = copy_warmup(model, steps=COPY_STEPS, length=(8, 24), seed=0, log=logs.append)
    print(out["accuracy_before"], out["accuracy_after"], out["losses"][0], out["losses"][-1])
    assert out["accuracy_before"] < 0.1 and out["accuracy_after"] > 0.8
    assert out["losses"][-1] < out["losses"][0] / 3 and len(out["losses"]) == COPY_STEPS
    after = load_file(model / "model.safetensors")
    assert any((before[k] - after[k]).abs().max() > 1e-3 for k in before)
    assert logs == [f"copy warm-up: {COPY_STEPS} steps, copy accuracy on 8-24 tokens {out['accuracy_before']:.2f} "
                    f"-> {out['accuracy_after']:.2f}, on listings {out['accuracy_listings_before']:.2f} -> "
                    f"{out['accuracy_listings']:.2f}"]
    assert out["accuracy_first_stage"] is None


def test_copy_warmup_reach_stages_run_longer_sequences_in_smaller_batches(tmp_path, monkeypatch):
    """The reach stages: a third of reach_steps at half of reach_length, the rest at reach_length, with
    batches cut so a step holds about the tokens of a first-stage step; accuracy is measured on
    reach_length sequences, after the first stage too."""
    from transformers import AutoModelForImageTextToText

    from paravt_train.toy.tiny import build_tiny_model, copy_warmup

    model = build_tiny_model(tmp_path / "m", ["red green blue 12 13"] * 4, size="test")
    seen = []  # (training?, input shape) of every forward pass
    load = AutoModelForImageTextToText.from_pretrained

    def load_and_watch(*a, **k):
        m = load(*a, **k)
        m.register_forward_pre_hook(lambda mod, args, kw: seen.append((mod.training, tuple(kw["input_ids"].shape))),
                                    with_kwargs=True)
        return m

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", load_and_watch)
    logs = []
    out = copy_warmup(model, steps=4, batch_size=8, length=(8, 24), reach_steps=6, reach_length=(40, 96), seed=0,
                      log=logs.append)
    assert len(out["losses"]) == 10 and out["accuracy_first_stage"] is not None
    train = [shape for training, shape in seen if training]
    assert [b for b, _ in train] == [8] * 4 + [8] * 2 + [4] * 4  # 8 * 24 / 48 * 2 = 8, then 8 * 24 / 96 * 2 = 4
    assert all(w <= 48 for _, w in train[:4]) and all(40 <= w <= 96 for _, w in train[4:6])
    assert all(80 <= w <= 192 for _, w in train[6:]) and max(w for _, w in train[6:]) > 96
    # 3 evaluations of 32 sequences, 8 at a time, and 2 of 32 listings (before and after)
    held = [shape for training, shape in seen if not training]
    assert len(held) == 20 and sum(80 <= w <= 192 for _, w in held) >= 12
    assert logs[0].startswith("copy warm-up: 4 steps on 8-24 tokens; accuracy on 40-96 tokens")
    assert logs[-1].startswith("copy warm-up: 10 steps, copy accuracy on 40-96 tokens")


def test_copy_warmup_listing_stage_copies_random_listings(tmp_path, monkeypatch):
    """The listing stage: after the random-token steps, listing_steps batches that repeat random listings of
    the toy's colours and seconds (a copy of repeating pieces), measured on held-out listings."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from paravt_train.toy.tiny import build_tiny_model, copy_warmup

    model = build_tiny_model(tmp_path / "m", corpus(sft_rows([make_world(s) for s in range(4)], SCHEMA)),
                             size="test", vocab_size=600)
    tok = AutoTokenizer.from_pretrained(model)
    seen = []  # (training?, input ids) of every forward pass
    load = AutoModelForImageTextToText.from_pretrained

    def load_and_watch(*a, **k):
        m = load(*a, **k)
        m.register_forward_pre_hook(lambda mod, args, kw: seen.append((mod.training, kw["input_ids"])),
                                    with_kwargs=True)
        return m

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", load_and_watch)
    logs = []
    out = copy_warmup(model, steps=2, batch_size=4, length=(8, 24), listing_steps=3, seed=0, log=logs.append)
    assert len(out["losses"]) == 5 and 0 <= out["accuracy_listings"] <= 1
    train = [ids for training, ids in seen if training]
    assert [ids.shape[0] for ids in train] == [4] * 5
    for ids in train[2:]:  # each row: a listing, then the same listing again
        for row in ids.tolist():
            row = [t for t in row if t != tok.pad_token_id]
            half = len(row) // 2
            assert row[:half] == row[half:]
            entries = tok.decode(row[:half]).strip().rstrip(".").split("; ")
            assert 4 <= len(entries) <= 16
            assert all(e.split()[0] in COLOURS and 0 <= int(e.split()[1]) < 128 for e in entries)
    assert logs[0].startswith("copy warm-up: 2 steps on 8-24 tokens")
    assert logs[-1].startswith("copy warm-up: 5 steps, copy accuracy on 8-24 tokens") and "on listings" in logs[-1]


def test_listing_copy_rows():
    rows = copy_rows(20, [], seed=1, kind="listings")
    assert rows == copy_rows(20, [], seed=1, kind="listings") and rows != copy_rows(20, [], seed=2, kind="listings")
    for r in rows:
        user, reply = r["messages"]
        seq = user["content"].removeprefix("Repeat: ")
        assert reply["content"] == f"<think>\n{seq}</think>\n<answer>{seq.split()[-1]}</answer>"
        entries = seq.rstrip(".").split("; ")
        assert 4 <= len(entries) <= 16 and all(e.split()[0] in COLOURS for e in entries)
    with pytest.raises(ValueError, match="tokens or listings"):
        copy_rows(1, [], kind="words")


def test_the_quick_demo_labels_each_row_and_says_its_estimate_up_front(toy_policy_dir, tmp_path, capsys):
    """`paravt-train quickstart` by default: 4 held-out videos (the full table is --full), an estimate of the whole
    run printed before any answer, and each table row's progress bar labelled with the row it is."""
    from paravt_train.toy.quickstart import FULL, QUICK, estimate, run

    assert QUICK["worlds"] < FULL["worlds"] == 16
    assert estimate(100, load=1.0, cores=2) == pytest.approx(16.0) and estimate(100, load=4.0, cores=2) == 32.0
    logs = []
    out = run(toy_policy_dir, out=tmp_path / "qs", modes=("parallel", "none"), ns=(8,), roles=0, progress=True,
              log=logs.append)
    assert logs[1].startswith("4 held-out videos") and logs[1].endswith("2 table rows of 20 answers")
    assert logs[2].startswith("estimate: about ") and "--full for the docs table" in logs[2]
    trace = next(i for i, m in enumerate(logs) if "=== one full trace" in m)
    assert trace > 2 and logs[trace + 3].startswith("the first answer took ")  # the estimate, measured here
    assert estimate(100, load=1.0, cores=2, contention=3.0) == pytest.approx(48.0)
    assert "about" in next(m for m in logs if m.startswith("  parallel   n=8")) and "left" in next(
        m for m in logs if m.startswith("  parallel   n=8"))
    bars = capsys.readouterr().err
    assert "row 1 of 2: parallel, n = 8" in bars and "row 2 of 2: none, n = 8" in bars
    assert set(out["results"]) == {("parallel", 8), ("none", 8)}
