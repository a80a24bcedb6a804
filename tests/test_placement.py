"""Where the local backend runs and what a decoding step costs: the device ``auto`` picks, the patch embedding as a
matrix product, a decoding step without host syncs of its own, a second rank without a GPU of its own refused."""

from __future__ import annotations

import pytest
import torch

from paravt_agent.policy.base import Sampling
from paravt_agent.policy.local import LocalPolicy
from paravt_agent.policy.placement import (
    GPU_MIN_WEIGHT_BYTES,
    patch_embed_as_matmul,
    resolve_device,
    weight_bytes,
)
from paravt_agent.prompts import planner_messages


def overview(media, n):
    from paravt_agent.video import VideoReader

    clip = VideoReader(media["video"]).overview(n=n)
    return planner_messages("You are a video understanding agent.", clip.frames, clip.timestamps, 40.0, "Which colour?")


@pytest.mark.gpu
def test_auto_keeps_a_small_model_on_the_cpu_and_puts_a_large_one_on_the_gpu(toy_policy_dir, tmp_path, monkeypatch):
    """The rule on a machine that has a GPU: the 1.2 M-parameter toy stays on the CPU (a GPU decodes it slower), a
    model with 64 MiB of weights or more goes to the GPU; an explicit device is kept; without a GPU, the CPU."""
    assert weight_bytes(toy_policy_dir) < GPU_MIN_WEIGHT_BYTES
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:  # sparse: the size is what counts
        f.truncate(GPU_MIN_WEIGHT_BYTES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", toy_policy_dir) == "cpu"
    assert resolve_device("auto", big) == "cuda"
    assert resolve_device("cuda", toy_policy_dir) == "cuda" and resolve_device("cpu", big) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", big) == "cpu"


def test_the_patch_embedding_as_a_matrix_product_gives_the_convolutions_features(tiny_model, media):
    """The vision tower's output with the patch embedding as a matmul equals the Conv3d's (float32 rounding)."""
    from transformers import AutoModelForImageTextToText

    policy = LocalPolicy(tiny_model, reuse=False)
    enc = policy.encode(overview(media, 4))
    conv_model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()
    grid = torch.tensor(enc.image_grid_thw)
    with torch.no_grad():
        want = conv_model.model.visual(enc.pixel_values, grid_thw=grid).pooler_output
        assert patch_embed_as_matmul(conv_model) == 1  # Qwen3-VL's one patch embedding
        got = conv_model.model.visual(enc.pixel_values, grid_thw=grid).pooler_output
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the policy's own model runs that way, and its answers are the ones the trainer's model scores
    assert type(policy.model.model.visual.patch_embed.forward).__name__ == "_MatmulPatchEmbed"


def host_syncs(fn) -> int:
    """Host syncs while ``fn`` runs: device values read on the host (free on the CPU, a stall of the whole GPU on
    one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages()
               if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize"))


@pytest.mark.gpu
def test_a_decoding_step_makes_no_host_sync_of_its_own(tiny_model, media, device, dtype):
    """A batch of 4 greedy rows of different lengths syncs at most twice per decoding step, both transformers' own
    (its "are all rows done?" and, with left padding, its attention-mask check: once for rows of one length), not
    once per row (before: 6); the sampler adds none for greedy rows and, for a sampled row, none beyond
    ``torch.multinomial``'s own argument checks on the CPU (2 per draw there, none on a GPU)."""
    from paravt_agent.policy.batcher import RowSampler

    policy = LocalPolicy(tiny_model, device=device, dtype=dtype, reuse=False)
    policy.chat.placeholder_ids.append(policy.eos_id)  # every row runs to its limit

    def generate(tokens: int):
        rows = [(overview(media, n), Sampling(max_new_tokens=tokens), "") for n in (2, 3, 4, 5)]
        return lambda: policy.generate_batch(rows)

    host_syncs(generate(2))  # warm-up
    per_step = (host_syncs(generate(17)) - host_syncs(generate(1))) / 16
    assert per_step <= 2.0, per_step
    dev = policy.model.device
    scores = torch.randn(3, 500, device=dev)
    greedy = RowSampler([Sampling(), Sampling(), Sampling()], banned=[3, 4])
    sampled = RowSampler([Sampling(), Sampling(temperature=1.0, seed=1, top_p=0.9, top_k=20), Sampling(min_p=0.1,
                                                                                                        temperature=0.7)],
                         banned=[3, 4])
    for sampler in (greedy, sampled):
        sampler(None, scores)  # the first call makes its generators and banned ids on the device
    assert host_syncs(lambda: greedy(None, scores)) == 0
    assert host_syncs(lambda: sampled(None, scores)) <= (2 * 2 if dev.type == "cpu" else 0)
    if dev.type == "cuda":  # every kind of sync (.tolist(), .cpu(), a boolean mask…) raises in this mode
        torch.cuda.set_sync_debug_mode("error")
        try:
            greedy(None, scores)
            sampled(None, scores)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_a_second_rank_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """NCCL puts one rank on one GPU: a rank whose LOCAL_RANK has no GPU is refused with what to do, before it
    joins a group the others would wait in."""
    from paravt_agent.errors import ConfigError
    from paravt_train.infra.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"local rank 1 has no GPU of its own.*CUDA_VISIBLE_DEVICES"):
        init_distributed()


@pytest.mark.gpu
def test_the_trainers_place_by_size_as_the_local_backend_does(toy_policy_dir, toy_rl, tmp_path, monkeypatch):
    """SFT and GRPO take the same rule (``device: auto``): on a machine with a GPU the toy trains on the CPU (before:
    any visible GPU), a 64 MiB model on the GPU, ``device: cuda`` asks for it; ``cuda`` without one is refused. The
    GRPO trainer built on a GPU machine with the toy puts its model on the CPU and trains in float32."""
    from paravt_agent.errors import ConfigError
    from paravt_train.infra.distributed import train_device
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer
    from paravt_train.sft.config import SFTConfig

    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(GPU_MIN_WEIGHT_BYTES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train_device("auto", toy_policy_dir) is False and train_device("auto", big) is True
    assert train_device("cuda", toy_policy_dir) is True and train_device("cpu", big) is False
    assert SFTConfig(model=toy_policy_dir, data="x.parquet").device == "auto"
    cfg = GRPOConfig(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"],
                     output_dir=str(tmp_path / "run"), steps=1, prompts_per_step=1, group_size=2)
    tr = GRPOTrainer(cfg, progress=False)
    tr.setup()  # with "a GPU" present: the toy stays on the CPU, and bf16 auto stays off there
    assert tr.device.type == "cpu" and next(tr.model.parameters()).device.type == "cpu"
    assert tr.autocast_dtype is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no GPU"):
        train_device("cuda", toy_policy_dir)
