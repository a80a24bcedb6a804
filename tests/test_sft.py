"""SFT on a tiny model: label masking, learning, exact resume, LoRA, and FSDP2 over gloo."""

import json
import os
import subprocess
import sys

import pytest

from paravt_agent.prompts import SUBAGENT_SYSTEM_PROMPT, TOOL_SYSTEM_PROMPT, question_text, subagent_request
from paravt_train.data import load_sft, render_messages, validate_file, write_parquet
from paravt_train.sft import build_example, train
from paravt_train.sft.config import SFTConfig
from paravt_train.toy.render import write_segments

COLOURS = {"red": (230, 25, 75), "green": (60, 180, 75), "blue": (0, 130, 200), "yellow": (255, 225, 25)}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    names = list(COLOURS)
    rows = []
    for v in range(4):
        order = names[v:] + names[:v]
        write_segments(d / f"v{v}.mp4", [(COLOURS[c], 2.0) for c in order], fps=4, width=32, height=32)
        q = "Which colour comes first?"
        rows.append({"id": f"p{v}", "messages": [
            {"role": "system", "content": TOOL_SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "video", "video": f"v{v}.mp4", "n_frames": 4},
                                         {"type": "text", "text": question_text(q)}]},
            {"role": "assistant",
             "content": f"<think>\nThe first frame is {order[0]}.</think>\n<answer>{order[0]}</answer>"},
        ]})
        rows.append({"id": f"s{v}", "messages": [
            {"role": "system", "content": SUBAGENT_SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "video", "video": f"v{v}.mp4", "start": 2.0, "end": 4.0},
                                         {"type": "text", "text": subagent_request(q)}]},
            {"role": "assistant", "content": f"2 {order[1]}; 3 {order[1]}; 4 {order[2]}"},
        ]})
    write_parquet(rows, d / "train.parquet")
    return d


def cfg_for(tiny_model, sft_data, out, **kw):
    base = dict(model=tiny_model, data=str(sft_data / "train.parquet"), video_root=str(sft_data), output_dir=str(out),
                lr=3e-3, batch_size=4, micro_batch_size=2, max_steps=6, save_every=3, warmup_ratio=0.0,
                frames={"max_pixels": 1024, "crop_fps": 1.0}, seed=1)
    base.update(kw)
    return SFTConfig(**base)


def test_assistant_tokens_only(tiny_model, sft_data):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    samples = load_sft(sft_data / "train.parquet", sft_data)
    for s in samples[:2]:
        ex = build_example(render_messages(s.messages, sft_data, cfg_for(tiny_model, sft_data, "x").frames), proc)
        labelled = [t for t in ex["labels"] if t != -100]
        want = s.messages[-1].content
        assert proc.tokenizer.decode(labelled) == want + "<|im_end|>"
        assert ex["pixel_values"].shape[0] > 0


def test_context_only_assistant_turns(tiny_model):
    """``train: false`` keeps an assistant turn in the context and out of the loss (mask history)."""
    from transformers import AutoProcessor

    from paravt_train.data import SFTSample

    proc = AutoProcessor.from_pretrained(tiny_model)
    msgs = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "<think>\nfirst turn</think>\n<tool_call>x</tool_call>", "train": False},
        {"role": "user", "content": "<tool_response>\n[1] summary\n</tool_response>"},
        {"role": "assistant", "content": "<think>\nsecond</think>\n<answer>B</answer>"},
    ]
    sample = SFTSample.model_validate({"messages": json.dumps(msgs)})
    ex = build_example(render_messages(sample.messages), proc)
    labelled = proc.tokenizer.decode([t for t in ex["labels"] if t != -100])
    assert labelled == msgs[-1]["content"] + "<|im_end|>"
    assert "first turn" in proc.tokenizer.decode(ex["input_ids"])  # still in the context
    everything = build_example(render_messages(SFTSample.model_validate(
        {"messages": [{**m, "train": True} if m["role"] == "assistant" else m for m in msgs]}).messages), proc)
    assert "first turn" in proc.tokenizer.decode([t for t in everything["labels"] if t != -100])


def test_learns_and_resumes_exactly(tiny_model, sft_data, tmp_path, capsys):
    """A SIGTERM stops at a step boundary with a checkpoint, a crash loses what followed the last one, a truncated
    newest checkpoint falls back to the one before it: the resumed run's losses are the uninterrupted run's."""
    import signal

    from paravt_train.infra.checkpoint import CheckpointError

    full = train(cfg_for(tiny_model, sft_data, tmp_path / "a", resume=False), progress=False)
    assert len(full["losses"]) == 6
    logged = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]

    class Crash(Exception):
        pass

    def crash():
        raise Crash

    def at(when, what):
        def callback(step, loss):
            if step == when:
                what()
        return callback

    b = tmp_path / "b"
    stopped = train(cfg_for(tiny_model, sft_data, b), progress=False,
                    callback=at(2, lambda: os.kill(os.getpid(), signal.SIGTERM)))
    assert stopped["stopped"] == "SIGTERM" and stopped["steps"] == 2 and not (b / "final").exists()
    assert (b / "checkpoint-2" / "trainer_state.json").is_file()  # saved on the stop (save_every is 3)
    with pytest.raises(Crash):
        train(cfg_for(tiny_model, sft_data, b), progress=False, callback=at(4, crash))
    assert (b / "checkpoint-3" / "trainer_state.json").is_file()
    shard = max((b / "checkpoint-3").glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a disk that lost half the newest
    capsys.readouterr()
    resumed = train(cfg_for(tiny_model, sft_data, b), progress=False)
    assert "checkpoint-3 cannot be loaded" in capsys.readouterr().out
    assert len(resumed["losses"]) == 4  # steps 3, 4, 5, 6 (from checkpoint-2)
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5, abs=1e-6)
    # the final model is an ordinary model directory
    from paravt_agent.policy.local import LocalPolicy

    assert LocalPolicy(b / "final").model is not None
    # every checkpoint unreadable: a clear error, never a silent restart from step 0
    for c in b.glob("checkpoint-*"):
        (c / "extra.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint under .* can be loaded"):
        train(cfg_for(tiny_model, sft_data, b, max_steps=8), progress=False)


def test_paravt_train_sft_stops_on_sigterm_with_a_checkpoint(tiny_model, sft_data, tmp_path):
    """The CLI under a scheduler's SIGTERM: the step in flight finishes, is checkpointed, and the process exits
    143 saying how to continue."""
    import signal
    import time

    import yaml

    out = tmp_path / "run"
    cfg = cfg_for(tiny_model, sft_data, out, max_steps=500, save_every=0, resume=False).model_dump(mode="json")
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "paravt_train.cli", "sft", "--config",
                             str(tmp_path / "sft.yaml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=240)
    assert proc.returncode == 143, text
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 2 <= last < 500 and (out / f"checkpoint-{last}" / "trainer_state.json").is_file(), text
    assert f"stopped by SIGTERM after step {last}" in text and not (out / "final").exists()


@pytest.mark.dtype
def test_loss_goes_down(tiny_model, sft_data, tmp_path, dtype):
    res = train(cfg_for(tiny_model, sft_data, tmp_path / "c", max_steps=25, save_every=0, resume=False,
                        bf16="true" if dtype == "bfloat16" else "false"), progress=False)
    assert res["losses"][-1] < 0.6 * res["losses"][0]


def test_lora(tiny_model, sft_data, tmp_path):
    cfg = cfg_for(tiny_model, sft_data, tmp_path / "l", max_steps=4, save_every=0, resume=False, lr=1e-2,
                  lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    res = train(cfg, progress=False)
    assert res["losses"][-1] < res["losses"][0]
    from safetensors.torch import load_file

    sd = load_file(tmp_path / "l" / "final" / "model.safetensors")
    assert not any("lora" in k for k in sd)  # merged into a plain model


def test_bad_rows_are_reported(tmp_path, sft_data):
    rows = [
        {"messages": json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])},
        {"messages": "{not json"},
        {"messages": json.dumps([{"role": "user", "content": "no answer"}])},
        {"messages": json.dumps([{"role": "user", "content": [{"type": "video", "video": "missing.mp4"}]},
                                 {"role": "assistant", "content": "x"}])},
    ]
    write_parquet(rows, tmp_path / "bad.parquet")
    ok, bad = validate_file(tmp_path / "bad.parquet", "sft", sft_data)
    assert len(ok) == 1 and [r for r, _ in bad] == [1, 2, 3]
    assert "not valid JSON" in bad[0][1] and "assistant" in bad[1][1] and "video not found" in bad[2][1]
    res = subprocess.run([sys.executable, "-m", "paravt_train.cli", "validate-data", str(tmp_path / "bad.parquet"),
                          "--video-root", str(sft_data)],
                         capture_output=True, text=True)
    assert (res.returncode == 1 and "row 1: messages: not valid JSON" in res.stdout
            and "1 valid, 3 invalid" in res.stdout)


def test_fsdp2_on_two_hosts_matches_one_process(tiny_model, sft_data, tmp_path, host_bed):
    """`paravt-train sft` under torchrun across two hosts (a node each: torchrun's multi-node rendezvous, FSDP2 on
    gloo over the hosts' network, each node's gloo on its own interface) takes the steps one process takes: the
    same losses, gradient norms and final weights."""
    import yaml

    def write_cfg(name):
        cfg = cfg_for(tiny_model, sft_data, tmp_path / name, max_steps=2, save_every=0, resume=False).model_dump()
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    from tests.hosts import torchrun

    bed = host_bed(["node0", "node1"])
    # FSDP2 over gloo on the CPU, on a GPU machine too: the claim is the sharded update's, in float32 (NCCL puts one
    # rank on one GPU, and bf16 autocast on a GPU would round both runs differently)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    two = torchrun([bed["node0"], bed["node1"]], ["-m", "paravt_train.cli", "sft", "--config", str(write_cfg("two"))],
                   env, timeout=300)
    one = subprocess.run([sys.executable, "-m", "paravt_train.cli", "sft", "--config", str(write_cfg("one"))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert [r.returncode for r in two] == [0, 0], [r.stdout[-3000:] for r in two]
    ra = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(ra) == len(rb) == 2
    assert [r["loss"] for r in rb] == pytest.approx([r["loss"] for r in ra], rel=1e-4, abs=1e-5)
    # the same gradient, not just the same loss: AdamW would hide a gradient scaled by 1/W in the weights
    assert [r["grad_norm"] for r in rb] == pytest.approx([r["grad_norm"] for r in ra], rel=1e-4)
    from safetensors.torch import load_file

    a = load_file(tmp_path / "one" / "final" / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4  # the gathered FSDP2 weights match


def test_rows_that_cannot_render_are_refused_before_training(tiny_model, sft_data, tmp_path):
    """A crop past the video's end and a text file as the video pass the schema but would crash rendering:
    validate-data reports them with their row numbers, and sft refuses them before the model loads."""
    (tmp_path / "notes.mp4").write_text("not a video at all")
    import shutil

    shutil.copy(sft_data / "v0.mp4", tmp_path / "v0.mp4")
    q = "Which colour comes first?"
    rows = [
        {"messages": json.dumps([{"role": "user", "content": [{"type": "video", "video": "v0.mp4", "n_frames": 2},
                                                              {"type": "text", "text": q}]},
                                 {"role": "assistant", "content": "red"}])},
        {"messages": json.dumps([{"role": "user", "content": [{"type": "video", "video": "v0.mp4", "start": 50.0,
                                                               "end": 60.0}, {"type": "text", "text": q}]},
                                 {"role": "assistant", "content": "red"}])},
        {"messages": json.dumps([{"role": "user", "content": [{"type": "video", "video": "notes.mp4"},
                                                              {"type": "text", "text": q}]},
                                 {"role": "assistant", "content": "red"}])},
    ]
    write_parquet(rows, tmp_path / "d.parquet")
    ok, bad = validate_file(tmp_path / "d.parquet", "sft", tmp_path)
    assert len(ok) == 1 and [r for r, _ in bad] == [1, 2]
    assert "beyond the end" in bad[0][1] and "not a video" in bad[1][1]
    from paravt_train.data import DataError

    cfg = cfg_for(tiny_model, sft_data, tmp_path / "out", data=str(tmp_path / "d.parquet"), video_root=str(tmp_path))
    with pytest.raises(DataError, match="row 1"):
        train(cfg, progress=False)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing trained
