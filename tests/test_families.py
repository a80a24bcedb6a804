"""Every model family the seed methods train, on every backend (issue 63): a tiny model of Qwen3-VL (the shipped toy),
Qwen2.5-VL and Qwen2-VL (built here, each with its family's real processor settings), and for each: the frames every
path makes (reader, crop_video, SFT, the trainer's collate, the SGLang client) on a 16:9 video, a square one and one
smaller than a frame unit; the agent end to end locally and against SGLang 0.5.23's CPU engine with the same tokens;
the trainer re-scoring what was generated; two SFT steps and the agent config they save; a GRPO step that pushes its
weights to SGLang from disk; grounding boxes mapped back to the source video's pixels; the methods whose papers train
Qwen2.5-VL (weaver, videochat-m1) stepping on it; and the guard on ``mm_token_type_ids``.

Each family's tests run together on one server of its own (the toy's is the session's shared one)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from paravt_agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError, PolicyError
from paravt_agent.policy.local import LocalPolicy
from paravt_agent.policy.sglang_backend import SGLangPolicy
from paravt_agent.types import Sampling
from paravt_train.toy.render import write_segments, write_video
from tests.conftest import FLOAT32_BOUND, engine_unavailable

FAMILIES = ["qwen3_vl", "qwen2_5_vl", "qwen2_vl"]
CORPUS = ["red green blue yellow purple orange window shows seconds answer question square where"] * 4
COLOURS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200)]
SHORT = {"planner_sampling": {"max_new_tokens": 12}, "subagent_sampling": {"max_new_tokens": 8}, "max_turns": 1}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """A 16:9 video, a square one and one smaller than any family's frame unit (8 s, a new colour every 2 s)."""
    d = tmp_path_factory.mktemp("family-videos")
    segs = [(COLOURS[i % 4], 2.0) for i in range(4)]
    return {name: write_segments(d / f"{name}.mp4", segs, fps=4, width=w, height=h, gop=4)
            for name, (w, h) in {"wide": (320, 180), "square": (96, 96), "tiny": (20, 20)}.items()}


@pytest.fixture(scope="module")
def builds(tmp_path_factory, toy_policy_dir):
    """Each family's tiny model: the shipped toy for Qwen3-VL, a fresh build of the others."""
    from paravt_train.toy.families import build_family_model

    return {name: toy_policy_dir if name == "qwen3_vl" else str(
        build_family_model(tmp_path_factory.mktemp(name) / "model", name, CORPUS, size="test")) for name in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, builds):
    """One family: its model directory and the geometry its files state."""
    from paravt_agent.policy.families import geometry_of_dir

    return SimpleNamespace(name=request.param, dir=builds[request.param],
                           geometry=geometry_of_dir(builds[request.param]))


@pytest.fixture(scope="module")
def family_servers(builds, tmp_path_factory):
    """SGLang 0.5.23 on CPU serving the built families' models, started as `paravt serve` starts it, the two at once
    on first use (each takes a core for most of a minute), stopped when the module ends."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.sglang_cpu.server import SGLangServer, unavailable

    engine_unavailable(unavailable())
    logs = tmp_path_factory.mktemp("sglang-logs")
    names = [n for n in FAMILIES if n != "qwen3_vl"]
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(SGLangServer, builds[n], logs) for n in names}
    servers = {n: f.result() for n, f in futures.items()}
    yield servers
    for srv in servers.values():
        srv.close()


@pytest.fixture
def served(family, real_sglang, request):
    """The family's server, on its launch weights for this test: the toy's is the session's shared one, the others'
    this module's."""
    shared = family.name == "qwen3_vl"
    srv = real_sglang(family.dir) if shared else request.getfixturevalue("family_servers")[family.name]
    srv.reset()
    yield srv
    if shared:
        srv.reset()


def visual_tokens(ids: list[int], policy) -> int:
    return ids.count(policy.chat.image_token_id)


def frames_of(messages) -> list[np.ndarray]:
    return [p["image"] for m in messages if not isinstance(m["content"], str) for p in m["content"]
            if p["type"] == "image"]


def test_every_path_sizes_frames_by_the_models_own_geometry(family, videos, tmp_path):
    """The unit, pixel bounds and box convention come from the model; the reader, crop_video, SFT's examples and the
    trainer's collate all see each frame at a size the model's processor keeps (a multiple of its unit, one unit at
    least): before, every family got Qwen3-VL's 32, which the local processor shrank again for Qwen2.5-VL and
    Qwen2-VL (160x288 -> 140x280) while a server did not."""
    from paravt_agent.policy.families import FAMILIES as KNOWN
    from paravt_train.rl.rollout import TokenSequence
    from paravt_train.rl.scoring import collate
    from paravt_train.sft import build_example
    from tools.builtin import CropVideo, CropVideoArgs

    geo = family.geometry
    local = LocalPolicy(family.dir)
    agent = Agent(policy=local)
    assert agent.config.frames.factor == geo.unit == {"qwen3_vl": 32}.get(family.name, 28)
    assert geo.boxes == KNOWN[family.name][1]
    mine = local.chat.geometry  # the loaded processor states what its files say
    assert (mine.patch, mine.merge, mine.min_pixels, mine.max_pixels) == (geo.patch, geo.merge, geo.min_pixels,
                                                                         geo.max_pixels)
    for name, video in videos.items():
        inp = agent.prepare(video, "Which colour?", n_frames=4)
        frames = frames_of(inp.messages)
        crop = asyncio.run(CropVideo().run(CropVideoArgs(start_time=1, end_time=5), inp.context))
        for f in [*frames, *crop.frames]:
            h, w = f.shape[:2]
            assert h % geo.unit == 0 and w % geo.unit == 0 and min(h, w) >= geo.unit, (name, f.shape)
            assert geo.seen(h, w) == (h, w)  # the processor keeps it as it is
        if name == "tiny":
            assert frames[0].shape[:2] == (geo.unit, geo.unit)  # smaller than a unit: read at one unit a side
        want = sum(geo.tokens(*f.shape[:2]) for f in frames)
        enc = local.encode(inp.messages)
        assert visual_tokens(enc.ids, local) == want
        ex = build_example([*inp.messages, {"role": "assistant", "content": "red"}], local.processor)
        assert visual_tokens(ex["input_ids"], local) == want  # SFT's example of the same conversation
        seq = TokenSequence(role="planner", input_ids=enc.ids, loss_mask=[0] * len(enc.ids),
                            logprobs=[0.0] * len(enc.ids), images=frames, image_grid_thw=enc.image_grid_thw)
        batch = collate([seq], local.chat)  # the trainer's pixel values: the grids the policy saw
        assert int(batch["mm_token_type_ids"].sum()) == want
    other = 28 if geo.unit == 32 else 32
    with pytest.raises(ConfigError, match=rf"frames.factor: {other} contradicts.*multiples of {geo.unit} pixels"):
        Agent(policy=local, config=AgentConfig(frames={"factor": other}))


def test_paravt_serve_gives_sglang_the_familys_frame_sizes(family):
    """`paravt serve` tells SGLang the family's sizes (min one unit, max the model's): before, it lowered min_pixels to
    32² for every family (a 28x28 Qwen2.5-VL frame then cost 4 visual tokens on the server, 1 on the client) and said
    nothing of Qwen2-VL, whose size SGLang replaces with its own."""
    from typer.testing import CliRunner

    from paravt_agent.cli import app

    res = CliRunner().invoke(app, ["serve", family.dir, "--device", "cpu", "--dry-run"])
    assert res.exit_code == 0, res.output
    flag = re.search(r"--mm-process-config '?(\{[^ ']+\})", res.stdout)
    assert flag, res.stdout
    unit = family.geometry.unit
    assert json.loads(flag.group(1)) == {"image": {"size": {"shortest_edge": unit * unit,
                                                            "longest_edge": family.geometry.max_pixels}}}
    assert f"{unit}-pixel unit" in res.stderr


def test_the_agent_answers_locally_and_on_sglang_with_the_same_tokens(family, served, videos):
    """For each video, the SGLang client and the local backend send the model the same prompt ids (visual tokens
    included) and get the same greedy tokens and logprobs back; the whole agent answers on both. Before, Qwen2.5-VL
    and Qwen2-VL failed every call on SGLang ("consumed 480 visual tokens but this client computed 400")."""
    local = LocalPolicy(family.dir)
    remote = SGLangPolicy(model=family.dir, endpoint=served.url)
    agent = Agent(policy=local)
    for name, video in videos.items():
        inp = agent.prepare(video, "Which colour comes first?", n_frames=4)
        here = local.generate_sync(inp.messages, Sampling(max_new_tokens=6))
        there = asyncio.run(remote.generate(inp.messages, Sampling(max_new_tokens=6)))
        assert there.prompt_source == "server" and there.prompt_ids == here.prompt_ids, name
        assert there.output_ids == here.output_ids, name
        assert max(abs(a - b) for a, b in zip(there.logprobs, here.logprobs, strict=True)) < FLOAT32_BOUND["batch"]
    for policy in (local, remote):
        ans = Agent(policy=policy, config=AgentConfig(**SHORT)).answer(videos["wide"], "Which colour?", ["red", "blue"])
        assert ans.records and not any("visual tokens" in e for e in ans.trace.errors), ans.trace.errors
        first = ans.records[0].generation
        assert visual_tokens(first.prompt_ids, local) == sum(family.geometry.tokens(*f.shape[:2])
                                                             for f in ans.records[0].images)


def test_the_trainer_rescores_what_the_policy_generated(family, videos):
    """The trainer's collate and scoring forward give every sampled token the logprob the policy generated it with
    (float32: within the re-score bound), for each video shape."""
    from paravt_train.rl.rollout import TokenSequence
    from paravt_train.rl.scoring import collate, token_logprobs

    local = LocalPolicy(family.dir)
    agent = Agent(policy=local)
    worst = 0.0
    for video in videos.values():
        inp = agent.prepare(video, "Which colour comes first?", n_frames=4)
        gen = local.generate_sync(inp.messages, Sampling(max_new_tokens=10, temperature=1.0, seed=3))
        ids = [*gen.prompt_ids, *gen.output_ids]
        n = len(gen.prompt_ids)
        seq = TokenSequence(role="planner", input_ids=ids, loss_mask=[0] * n + [1] * len(gen.output_ids),
                            logprobs=[0.0] * n + list(gen.logprobs), images=frames_of(inp.messages),
                            image_grid_thw=gen.image_grid_thw)
        with torch.no_grad():
            lp, _ = token_logprobs(local.model, collate([seq], local.chat), temperature=1.0)
        scored = lp[0, n - 1:n - 1 + len(gen.output_ids)].tolist()
        worst = max(worst, *(abs(a - b) for a, b in zip(scored, gen.logprobs, strict=True)))
    assert worst <= FLOAT32_BOUND["rescore"], worst


def test_two_sft_steps_save_the_models_frame_unit(family, videos, tmp_path):
    """SFT renders, trains and saves with the model's unit: its agent_config.yaml says the factor the model has (before:
    32 for a Qwen2.5-VL model, without a warning)."""
    import yaml

    from paravt_agent.prompts import TOOL_SYSTEM_PROMPT, question_text
    from paravt_train.data import write_parquet
    from paravt_train.sft import train
    from paravt_train.sft.config import SFTConfig

    rows = [{"id": name, "messages": [
        {"role": "system", "content": TOOL_SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "video", "video": video, "n_frames": 4},
                                     {"type": "text", "text": question_text("Which colour comes first?")}]},
        {"role": "assistant", "content": "<think>\nThe first frame is red.</think>\n<answer>red</answer>"}]}
        for name, video in videos.items()]
    data = write_parquet(rows, tmp_path / "sft.parquet")
    out = tmp_path / "sft"
    res = train(SFTConfig(model=family.dir, data=str(data), output_dir=str(out), batch_size=3, micro_batch_size=3,
                          max_steps=2, lr=1e-3, warmup_ratio=0.0), progress=False)
    assert res["steps"] == 2 and all(np.isfinite(res["losses"]))
    saved = yaml.safe_load((out / "final" / "agent_config.yaml").read_text())
    assert saved["frames"]["factor"] == family.geometry.unit
    assert Agent(model=str(out / "final")).config.frames.factor == family.geometry.unit  # and it loads again


def test_a_grpo_step_rolls_out_on_sglang_and_pushes_its_weights_from_disk(family, served, toy_rl, tmp_path):
    """One GRPO step against SGLang: every episode's tokens are the server's (no visual-token mismatch), the trainer
    scores them as sampled, and the disk sync leaves the server scoring as the trained model, named by the step."""
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer

    cfg = GRPOConfig(model=family.dir, data=toy_rl["data"], video_root=toy_rl["video_root"], output_dir=str(tmp_path),
                     steps=1, prompts_per_step=1, group_size=2, max_new_tokens=24, subagent_max_new_tokens=12,
                     temperature=1.0, lr=1e-3, save_every=5, concurrency=2, gating=False, backend="sglang",
                     endpoint=served.url, agent={"frames": {"n_frames": 8}})
    tr = GRPOTrainer(cfg, progress=False)
    tr.run()
    (rec,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec["failed_episodes"] == 0, rec.get("failures")
    assert rec["logprob_mismatch"] < FLOAT32_BOUND["update"]
    assert served.get("/model_info").json()["weight_version"] == "1"
    ids = torch.randint(10, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    out = served.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                    "return_logprob": True, "logprob_start_len": 0})
    server = [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]
    with torch.no_grad():
        logits = tr.model(input_ids=torch.tensor([ids])).logits[0].float()
    mine = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert server == pytest.approx(mine, abs=1e-4)


@pytest.fixture(scope="module")
def boxed_video(tmp_path_factory):
    """4 s at 4 fps, 320x180, black with a white box at x 200-260, y 40-100."""
    def frame(_):
        img = np.zeros((180, 320, 3), np.uint8)
        img[40:100, 200:260] = 255
        return img

    return write_video(tmp_path_factory.mktemp("boxed") / "boxed.mp4", 16, frame, fps=4, width=320, height=180, gop=4)


def test_grounding_boxes_map_back_to_the_source_videos_pixels(family, boxed_video):
    """A model that boxes exactly what it sees, in its family's convention (Qwen2.5-VL: pixels of the image after its
    processor's resize; Qwen2-VL and Qwen3-VL: 0-1000): spatial_grounding maps its box back to the 320x180 video's
    pixels. Before, a Qwen2.5-VL box was scaled by a frame the model never saw (14 % off vertically) and a Qwen2-VL
    box was read as pixels."""
    from transformers import AutoProcessor

    from paravt_agent.policy.base import images_of, text_of
    from paravt_agent.policy.chat import ChatTokenizer
    from paravt_agent.policy.scripted import ScriptedPolicy

    chat = ChatTokenizer(AutoProcessor.from_pretrained(family.dir))
    relative = family.geometry.boxes == "relative-1000"

    def script(role, msgs):
        if role == "tool:spatial_grounding":
            img = np.array(images_of(msgs)[0])  # a writable copy for the processor
            h, w = img.shape[:2]
            _, gh, gw = chat.image_inputs([img])["image_grid_thw"][0].tolist()  # the size the model sees it at
            sh, sw = gh * family.geometry.patch, gw * family.geometry.patch
            ys, xs = np.nonzero(img.mean(-1) > 128)
            box = [xs.min() / w, ys.min() / h, (xs.max() + 1) / w, (ys.max() + 1) / h]
            scale = [1000, 1000] * 2 if relative else [sw, sh] * 2
            return json.dumps([{"bbox_2d": [round(v * s) for v, s in zip(box, scale, strict=True)], "label": "box"}])
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<answer>done</answer>"
        return '<tool_call>{"name": "spatial_grounding", "arguments": {"objects": ["white box"], "time": 1}}'\
               "</tool_call>"

    class Perceiving(ScriptedPolicy):  # a model of this family: its geometry and its box convention
        frame_geometry = family.geometry
        model_type = family.name

    ans = Agent(policy=Perceiving(script), config=AgentConfig(tools=["spatial_grounding"], think_prefix="",
                                                              frames={"max_pixels": 50176})).answer(
        boxed_video, "Where is the box?")
    found = ans.trace.turns[0].calls[0].summary
    box = [int(v) for v in re.search(r"box: \[(\d+), (\d+), (\d+), (\d+)\]", found).groups()]
    assert max(abs(a - b) for a, b in zip(box, [200, 40, 260, 100], strict=True)) <= 3, found


#: the methods whose papers train Qwen2.5-VL-7B, as a GRPO config states them: Weaver, VideoChat-M1, and AVATAR's
#: options (Temporal Advantage Shaping, the stratified replay buffer) on the plain GRPO baseline
QWEN2_5_METHODS = {"weaver": {"method": "weaver"}, "videochat-m1": {"method": "videochat-m1"},
                   "avatar": {"method": "vanilla-grpo", "tas_lambda": 0.5, "replay": {"enabled": True, "per_step": 2}}}


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
@pytest.mark.parametrize("method", list(QWEN2_5_METHODS))
def test_the_qwen2_5_vl_methods_step_on_a_qwen2_5_vl_model_against_sglang(family, served, toy_rl, tmp_path, method):
    """Weaver, VideoChat-M1 and AVATAR train Qwen2.5-VL in their papers: each one's GRPO step runs on a tiny Qwen2.5-VL
    against SGLang with the model's own geometry and the method's defaults (its tools' calls trained here: frozen tools
    on a served full fine-tuning run need a second server; the token budgets cut for the CPU)."""
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer

    agent = {"frames": {"n_frames": 8}, "collab": {"agent_sampling": {"max_new_tokens": 16}}}
    cfg = GRPOConfig(model=family.dir, data=toy_rl["data"], video_root=toy_rl["video_root"],
                     output_dir=str(tmp_path), steps=1, prompts_per_step=1, group_size=2, max_new_tokens=16,
                     subagent_max_new_tokens=8, save_every=5, concurrency=2, backend="sglang", endpoint=served.url,
                     tool_model_calls="train", agent=agent, **QWEN2_5_METHODS[method])
    tr = GRPOTrainer(cfg, progress=False)
    tr.run()
    assert tr.agent.config.preset == {"avatar": "paravt"}.get(method, method)
    assert tr.agent.config.frames.factor == 28
    (rec,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec["failed_episodes"] == 0 and rec["episodes"] >= 2, rec.get("failures")
    assert rec["logprob_mismatch"] < FLOAT32_BOUND["update"]
    assert served.get("/model_info").json()["weight_version"] == "1"


def test_images_without_their_token_types_are_refused_where_the_batch_is_built(tmp_path, videos):
    """transformers' Qwen2.5-VL positions images as text when a batch lacks ``mm_token_type_ids`` (no error: the
    logprobs just move); every builder of a forward batch (the local backend, the trainer's collate, SFT's collate)
    refuses such a batch instead, naming the input."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from paravt_train.sft.trainer import collate as sft_collate
    from paravt_train.toy.families import build_family_model

    path = build_family_model(tmp_path / "q25", "qwen2_5_vl", CORPUS)
    proc = AutoProcessor.from_pretrained(path)
    local = LocalPolicy(str(path))
    inp = Agent(policy=local).prepare(videos["wide"], "Which colour?", n_frames=2)
    enc = local.encode(inp.messages)
    ids = torch.tensor([enc.ids])
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": enc.pixel_values,
            "image_grid_thw": torch.tensor(enc.image_grid_thw), "mm_token_type_ids": local.chat.mm_token_types(ids)}
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    with torch.no_grad():
        with_types = model(**full).logits[0, -1]
        without = model(**{k: v for k, v in full.items() if k != "mm_token_type_ids"}).logits[0, -1]
    assert (with_types - without).abs().max() > 1e-4  # the hazard: silently other positions, no error

    class Untyped(type(proc)):  # a processor that does not produce the input (an older one)
        @property
        def model_input_names(self):
            return [n for n in super().model_input_names if n != "mm_token_type_ids"]

    untyped = Untyped(image_processor=proc.image_processor, tokenizer=proc.tokenizer,
                      video_processor=proc.video_processor, chat_template=proc.chat_template)
    bare = LocalPolicy(str(path), processor=untyped)
    with pytest.raises(PolicyError, match="no mm_token_type_ids"):
        bare.generate_sync(inp.messages, Sampling(max_new_tokens=2))
    ex = {"input_ids": enc.ids, "labels": [-100] * len(enc.ids), "frames": frames_of(inp.messages)}
    with pytest.raises(PolicyError, match="SFT's collate: the batch has images but no mm_token_type_ids"):
        sft_collate([ex], proc.tokenizer.pad_token_id, proc)
    wrong = {**ex, "mm_token_type_ids": [0] * len(enc.ids)}
    with pytest.raises(PolicyError, match="0 tokens are marked as image tokens"):
        sft_collate([wrong], proc.tokenizer.pad_token_id, proc)
    assert Path(path, "config.json").is_file()


def test_a_tiny_qwen3_vl_moe_builds_in_the_released_layout_and_runs_locally(tmp_path, videos):
    """Qwen3-VL-MoE (transformers 5.24 and SGLang 0.5.23 both serve it): the tiny build writes its experts in the
    released checkpoints' layout (the one SGLang reads; transformers reads either) with three deepstack layers, and
    the local agent runs it with Qwen3-VL's geometry. The suite serves and trains it nowhere else: docs/families.md
    says why."""
    from safetensors import safe_open

    from paravt_train.toy.families import build_family_model

    path = str(build_family_model(tmp_path / "moe", "qwen3_vl_moe", CORPUS))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        gate_up = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    local = LocalPolicy(path)
    assert gate_up == [4, 64, 96] and list(local.model.model.language_model.layers[0].mlp.experts.gate_up_proj.shape
                                           ) == [4, 96, 64]  # released [E, hidden, 2·inter]; loaded transposed
    assert local.model.config.vision_config.deepstack_visual_indexes == [0, 1, 2]
    agent = Agent(policy=local, config=AgentConfig(**SHORT))
    assert agent.config.frames.factor == 32
    ans = agent.answer(videos["wide"], "Which colour?", ["red", "blue"])
    first = ans.records[0]
    assert [f.shape[:2] for f in first.images] == [(160, 288)] * 8  # 8 s at 1 fps, sides of 32
    assert visual_tokens(first.generation.prompt_ids, local) == 8 * 5 * 9
