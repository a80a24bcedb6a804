import json
import os
import re
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)


def run(*args, env=None, check=True):
    return subprocess.run([os.path.join(BIN, args[0]), *args[1:]], capture_output=True, text=True, check=check,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_paravt_answer_local(tiny_model, media):
    out = run("paravt", "answer", media["video"], "Which colour is shown at 3 seconds?", "-o", "red", "-o", "green",
              "--model", tiny_model, "--n-frames", "4", "--set", "planner_sampling.max_new_tokens=16",
              "--set", "subagent_sampling.max_new_tokens=8", "--json").stdout
    trace = json.loads(out)
    assert trace["question"].startswith("Which colour") and len(trace["overview_timestamps"]) == 4
    assert trace["options"] == ["red", "green"] and trace["turns"][0]["text"].startswith("<think>")


def test_paravt_answer_errors_are_clear(tmp_path, tiny_model):
    res = run("paravt", "answer", str(tmp_path / "missing.mp4"), "q?", "--model", tiny_model, check=False)
    assert res.returncode == 1 and "no such file" in res.stderr and "Traceback" not in res.stderr
    from paravt_agent.defaults import default_model_dir
    from paravt_agent.errors import PolicyError

    with pytest.raises(PolicyError, match="paravt-train toy"):
        default_model_dir([tmp_path / "none"])
    res = run("paravt", "answer", str(tmp_path / "x.mp4"), "q?", "--model", tiny_model, "--mode", "diagonal",
              check=False)
    assert res.returncode == 1 and "mode" in res.stderr


def test_paravt_serve_dry_run():
    out = run("paravt", "serve", "Qwen/Qwen3-VL-8B-Instruct", "--port", "31000", "--tp", "2",
              "--mem-fraction", "0.8", "--dry-run").stdout
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in out and "sglang.launch_server" in out  # SGLang's own choice
    assert "--tp 2" in out and "--port 31000" in out and "--mem-fraction-static 0.8" in out
    assert "--tool-call-parser" in out and "--context-length" in out
    # the vision-feature cache: raised to the 64-frame minimum, or off for a server RL pushes a vision tower to
    cache = {mb: run("paravt", "serve", "m", "--vlm-cache-mb", mb, "--dry-run").stdout for mb in ("100", "0")}
    assert "SGLANG_VLM_CACHE_SIZE_MB=4096" in cache["100"] and "SGLANG_VLM_CACHE_SIZE_MB=0 " in cache["0"]
    # LoRA adapters up to a rank (a `weight_sync: lora` run's server); on CPU with SGLang's torch-native LoRA
    lora = {dev: run("paravt", "serve", "m", "--lora-rank", "16", "--device", dev, "--dry-run").stdout
            for dev in ("cuda", "cpu")}
    assert ("--enable-lora --max-lora-rank 16 --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj "
            "down_proj --max-loras-per-batch 3") in lora["cuda"]  # the trainer's modules, never SGLang's `all`
    assert "--lora-backend" not in lora["cuda"] and "--lora-backend torch_native" in lora["cpu"]
    assert "--enable-lora" not in out


def test_paravt_serve_dp_dry_run_puts_workers_behind_the_router():
    lines = run("paravt", "serve", "Qwen/Qwen3-VL-8B-Instruct", "--port", "31000", "--tp", "2", "--dp", "2",
                "--dry-run").stdout.strip().splitlines()
    assert len(lines) == 3
    assert "--port 31001" in lines[0] and "--base-gpu-id 0" in lines[0] and "--host 127.0.0.1" in lines[0]
    assert "--port 31002" in lines[1] and "--base-gpu-id 2" in lines[1] and "--tp 2" in lines[1]
    assert "sglang_router.launch_router" in lines[2] and "--port 31000" in lines[2]
    assert lines[2].endswith("--worker-urls http://127.0.0.1:31001 http://127.0.0.1:31002")
    # workers other hosts reach: registered under the serve host (0.5.1: always 127.0.0.1), or --worker-host
    lines = run("paravt", "serve", "m", "--host", "10.0.0.5", "--port", "31000", "--dp", "2",
                "--dry-run").stdout.strip().splitlines()
    assert "--host 10.0.0.5" in lines[0] and lines[2].endswith(
        "--worker-urls http://10.0.0.5:31001 http://10.0.0.5:31002")
    lines = run("paravt", "serve", "m", "--host", "0.0.0.0", "--worker-host", "10.0.0.6", "--dp", "2",
                "--dry-run").stdout.strip().splitlines()
    assert "--host 0.0.0.0" in lines[0] and "http://10.0.0.6:30001 http://10.0.0.6:30002" in lines[2]
    # keys: SGLang's and the router's, never printed
    out = run("paravt", "serve", "m", "--dp", "2", "--api-key", "user-secret", "--admin-api-key", "admin-secret",
              "--dry-run").stdout
    assert "secret" not in out and out.count("--api-key '***'") == 3 and out.count("--admin-api-key '***'") == 2
    out = run("paravt", "serve", "m", "--dry-run", env={"PARAVT_SGLANG_API_KEY": "from-env"}).stdout
    assert "--api-key '***'" in out and "from-env" not in out


def test_paravt_serve_without_sglang_says_how_to_install():
    res = run("paravt", "serve", "some/model", check=False)
    assert res.returncode == 1 and "pip install 'paravt[sglang]'" in res.stderr


def test_paravt_answer_default_is_the_toy_policy(tmp_path):
    """A toy video written by `paravt-train toy-video` (the videos the toy policy knows), answered by
    `paravt answer` without --model: the shipped toy policy crops and answers right."""
    from paravt_train.toy.world import make_world

    video = tmp_path / "talk.mp4"
    listed = run("paravt-train", "toy-video", str(video), "--seed", "7").stdout
    w = make_world(7, mcq=1, oe=1, tvg=1)
    oe = next(q for q in w.questions if q.task == "oe")
    assert f"{w.duration} s" in listed and f'"{oe.question}"' in listed
    out = run("paravt", "answer", str(video), oe.question, "--n-frames", "8",
              env={"PARAVT_HOME": str(tmp_path)}).stdout
    assert "planner turn 1" in out and "crop_video(" in out and f"Answer: {oe.answer}" in out
    prof = run("paravt", "answer", str(video), oe.question, "--n-frames", "8",
               "--profile", env={"PARAVT_HOME": str(tmp_path)}).stdout
    assert "decode overview" in prof and "planner prefill" in prof and "sub-agents (wall)" in prof
    assert re.search(r"subagent turn 1 call \d+ +\(encode [\d.]+, prefill [\d.]+, decode [\d.]+\)", prof)


def test_help_texts():
    for cmd in (["paravt", "--help"], ["paravt", "answer", "--help"], ["paravt", "serve", "--help"],
                ["paravt", "api", "--help"]):
        assert run(*cmd).returncode == 0


def test_paravt_serve_keeps_the_protocol_frame_size_and_seeds(tmp_path):
    """`paravt serve` gives SGLang the family's frame sizes (a processor whose min_pixels would upscale protocol frames
    gets min one unit), serves the model directory itself, and seeds with --deterministic; the old --max-pixels is
    ignored with a warning."""
    from paravt_train.toy.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path / "m", ["a b c"] * 4, size="test", min_pixels=65536))
    out = run("paravt", "serve", model, "--deterministic", "--dry-run", "--max-pixels", "50176",
              env={"PARAVT_HOME": str(tmp_path / "h")})
    assert "--enable-deterministic-inference" in out.stdout  # SGLang honours sampling seeds only then
    assert out.stdout.split("--model-path ")[1].split()[0] == model
    flag = json.loads(out.stdout.split("--mm-process-config ")[1].split()[0].strip("'"))
    assert flag == {"image": {"size": {"shortest_edge": 32 * 32, "longest_edge": 50176}}}
    assert "32-pixel unit (patch 16 x merge 2), 65536-50176 pixels" in out.stderr
    assert "--max-pixels is no longer a setting" in out.stderr
