"""Tiny models of every family the project trains, built offline (the test suite's): the toy's tokenizer and chat
template (the Qwen special tokens are the same in all of them), random weights, and each family's real processor
settings.

=================  =====================================  ==========================================================
family             processor (unit, pixels)               what a checkpoint of it needs that a config built in code
                                                          lacks (SGLang 0.5.23 reads it)
=================  =====================================  ==========================================================
``qwen3_vl``       16 x 2 = 32; the toy's 1024-50176      ``mrope_section`` and ``mrope_interleaved`` in the rope
                                                          parameters (:func:`paravt_train.toy.tiny.build_tiny_model`)
``qwen2_5_vl``     14 x 2 = 28; Qwen2.5-VL-7B's           ``mrope_section`` (else SGLang runs 1-D RoPE where
                   3136-12845056, CLIP mean and std       transformers runs MRoPE); a full-attention vision block
``qwen2_vl``       14 x 2 = 28; Qwen2-VL-7B's             ``mrope_section``; ``vision_config.in_chans``
                   3136-12845056, CLIP mean and std
``qwen3_vl_moe``   as ``qwen3_vl``                        the experts saved in the released checkpoints' layout
                                                          (SGLang transposes them unconditionally), exactly 3
                                                          deepstack layers (SGLang's MoE model hard-codes 3)
=================  =====================================  ==========================================================

The Qwen3-VL, Qwen2.5-VL and Qwen2-VL ones generate, re-score token for token and train in transformers 5.24, and
SGLang's CPU engine serves them with the same tokens (``tests/test_families.py``); the Qwen3-VL-MoE one runs locally
(docs/families.md says why it is not served and trained in the suite, and what a real checkpoint or a GPU could still
show).
"""

from __future__ import annotations

from pathlib import Path

from paravt_train.toy.tiny import CHAT_TEMPLATE, SIZES, SPECIAL_TOKENS, build_tiny_model, train_tokenizer

__all__ = ["FAMILY_NAMES", "QWEN2_PIXELS", "build_family_model"]

#: the families a tiny model can be built of, the toy's first
FAMILY_NAMES = ("qwen3_vl", "qwen2_5_vl", "qwen2_vl", "qwen3_vl_moe")
#: the released Qwen2.5-VL-7B and Qwen2-VL-7B processors' pixel bounds (min_pixels, max_pixels)
QWEN2_PIXELS = (56 * 56, 28 * 28 * 16384)


def build_family_model(out_dir: str | Path, family: str = "qwen3_vl", corpus=(), size: str = "test",
                       vocab_size: int = 2048, seed: int = 0, number_tokens: bool = False) -> Path:
    """A tiny randomly initialised model of ``family`` (:data:`FAMILY_NAMES`) in ``out_dir``: tokenizer, chat
    template, processor and weights, loadable by ``from_pretrained`` and SGLang alike."""
    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILY_NAMES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if family == "qwen3_vl":
        return build_tiny_model(out_dir, corpus, size=size, vocab_size=vocab_size, seed=seed,
                                number_tokens=number_tokens)
    import torch  # the model classes: only a build pays for torch and transformers

    out_dir = Path(out_dir)
    tok = train_tokenizer(corpus, vocab_size=vocab_size, number_tokens=number_tokens)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config, model_cls, processor = _parts(family, size, tok, ids)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = None
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if family == "qwen3_vl_moe":
        _legacy_expert_layout(out_dir)
    return out_dir


def _text_config(size: str, tok, ids: dict, interleaved: bool) -> dict:
    hidden, layers, heads, kv, inter, *_ = SIZES[size]
    head_dim = hidden // heads
    half = head_dim // 2
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            # written out: SGLang runs MRoPE only when the config names its sections (transformers assumes them)
            "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    if interleaved:
        rope["mrope_interleaved"] = True  # transformers' Qwen3-VL always interleaves; SGLang reads the flag
    return {"vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 32768,
            "tie_word_embeddings": True, "rope_parameters": rope, "pad_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"], "bos_token_id": None}


def _special_ids(ids: dict) -> dict:
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "tie_word_embeddings": True}


def _parts(family: str, size: str, tok, ids: dict):
    """``(config, model class, processor)`` of a tiny ``family`` model."""
    import transformers as tf  # the family's classes, by name

    hidden, _, _, _, _, vdepth, vhidden, vheads = SIZES[size]
    if family in ("qwen2_5_vl", "qwen2_vl"):
        low, high = QWEN2_PIXELS
        image = tf.Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                         size={"shortest_edge": low, "longest_edge": high})
        video = tf.Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                         size={"shortest_edge": low, "longest_edge": high})
        text = _text_config(size, tok, ids, interleaved=False)
        if family == "qwen2_5_vl":
            vision = {"depth": vdepth, "hidden_size": vhidden, "intermediate_size": 2 * vhidden, "num_heads": vheads,
                      "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      # the released model's layout scaled down: windowed attention with the last block full
                      "window_size": 112, "fullatt_block_indexes": [vdepth - 1], "tokens_per_second": 2}
            config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_special_ids(ids))
            proc = tf.Qwen2_5_VLProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                                          chat_template=CHAT_TEMPLATE)
            return config, tf.Qwen2_5_VLForConditionalGeneration, proc
        # Qwen2-VL: the vision hidden size is the merger's output (the text width); SGLang reads in_chans
        vision = {"depth": vdepth, "embed_dim": vhidden, "hidden_size": hidden, "num_heads": vheads, "mlp_ratio": 2,
                  "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **_special_ids(ids))
        proc = tf.Qwen2VLProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                                   chat_template=CHAT_TEMPLATE)
        return config, tf.Qwen2VLForConditionalGeneration, proc
    # Qwen3-VL-MoE: the toy's processor; 4 experts, 2 a token; SGLang's MoE model reads exactly 3 deepstack layers
    size_kw = {"shortest_edge": 32 * 32, "longest_edge": 50176}
    norm = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    image = tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, size=size_kw, **norm)
    video = tf.Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, size=size_kw, **norm)
    text = _text_config(size, tok, ids, interleaved=True)
    text.update({"head_dim": hidden // SIZES[size][2], "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": []})
    vision = {"depth": 3, "hidden_size": vhidden, "intermediate_size": 2 * vhidden, "num_heads": vheads,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": hidden,
              "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1, 2]}
    config = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_special_ids(ids))
    proc = tf.Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                               chat_template=CHAT_TEMPLATE)
    return config, tf.Qwen3VLMoeForConditionalGeneration, proc


def _legacy_expert_layout(out_dir: Path) -> None:
    """The experts of a saved Qwen3-VL-MoE in the released checkpoints' layout: transformers 5.24 saves
    ``gate_up_proj`` as [E, 2·inter, hidden] and ``down_proj`` as [E, hidden, inter], SGLang 0.5.23 transposes both
    unconditionally (``models/qwen3_vl_moe.py``); transformers loads either layout (it checks the dimensions)."""
    from safetensors.torch import load_file, save_file  # the saved weights, rewritten in place

    path = out_dir / "model.safetensors"
    weights = load_file(path)
    for key in list(weights):
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            weights[key] = weights[key].transpose(1, 2).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
