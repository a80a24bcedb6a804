"""What ``weight_sync: disk`` writes for the server (:class:`paravt_train.infra.checkpoint.ServerExport`): the serving
dtype, tied weights once, and after an update only the parts that changed."""

from __future__ import annotations

import json

import torch


def test_the_disk_sync_writes_the_serving_dtype_and_only_what_changed(toy_policy_dir, tmp_path):
    """``weight_sync: disk`` writes what the server loads: bf16 when serving bf16 (half the fp32 trainer's bytes),
    tied weights once; a second export after an update of the language model alone rewrites only its parts."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from paravt_train.infra.checkpoint import ServerExport

    model = AutoModelForImageTextToText.from_pretrained(toy_policy_dir)
    proc = AutoProcessor.from_pretrained(toy_policy_dir)
    exp = ServerExport(tmp_path / "current", proc, torch.bfloat16, "mode: parallel\n")
    exp.write(model)
    first = set(exp.written)
    assert any(p.startswith("model.visual") for p in first) and any("layers" in p for p in first)
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    assert exp.bytes < 0.55 * fp32
    with torch.no_grad():
        model.model.language_model.layers[1].mlp.down_proj.weight.add_(0.01)  # in place, as the optimizer does
    exp.write(model)
    assert exp.written == ["model.language_model.layers.1"]
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "current", dtype=torch.float32)
    want = model.model.language_model.layers[1].mlp.down_proj.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.model.language_model.layers[1].mlp.down_proj.weight, want)
    assert json.loads((tmp_path / "current" / "config.json").read_text())["dtype"] == "bfloat16"
