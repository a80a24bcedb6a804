"""Build a tiny Qwen3-VL-architecture model offline: a locally trained byte-level BPE
tokenizer with the Qwen special tokens, a Qwen3-VL chat template, a real
``Qwen3VLProcessor`` and randomly initialised weights, saved as an ordinary model
directory that ``transformers`` (``from_pretrained``, ``transformers serve``) loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SIZES", "SPECIAL_TOKENS", "build_tiny_model", "train_tokenizer"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
#: Added (non-special) tokens, single ids as in Qwen3: the structural tags of the protocol.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

#: Qwen3-VL-style chat template: images as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant' + '\\n' }}{%- endif -%}"
)

#: name -> (text hidden, layers, heads, kv heads, intermediate, vision depth, vision hidden, vision heads)
SIZES = {
    "test": (64, 2, 2, 1, 128, 1, 32, 2),
    "toy": (128, 4, 4, 2, 256, 2, 64, 2),
}


def _base_corpus() -> list[str]:
    """Text that covers the protocol, so the tokenizer has merges for it."""
    from paravt_agent.prompts import (
        FINAL_ANSWER_PROMPT,
        NO_TOOL_SYSTEM_PROMPT,
        SUBAGENT_SYSTEM_PROMPT,
        TOOL_SYSTEM_PROMPT,
    )

    lines = [TOOL_SYSTEM_PROMPT, NO_TOOL_SYSTEM_PROMPT, SUBAGENT_SYSTEM_PROMPT, FINAL_ANSWER_PROMPT]
    lines += [f"<{t:.1f} seconds> {t} {t:02d}:{t % 60:02d}" for t in range(0, 400)]
    lines += ['{"name": "crop_video", "arguments": {"start_time": 12, "end_time": 20}}', "<answer>B</answer>"]
    return lines


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048):
    """Byte-level BPE trained on ``corpus`` (plus the protocol text), wrapped as a ``Qwen2Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([*_base_corpus(), *corpus], trainer=trainer)
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in raw["model"]["merges"]]
    qt = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    qt.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    qt.add_tokens(ADDED_TOKENS)
    qt.chat_template = CHAT_TEMPLATE
    return qt


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str] = (),
    size: str = "test",
    vocab_size: int = 2048,
    seed: int = 0,
    max_pixels: int = 50176,
    min_pixels: int = 32 * 32,
) -> Path:
    """Write tokenizer, processor and a randomly initialised Qwen3-VL model to ``out_dir``."""
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    out_dir = Path(out_dir)
    tok = train_tokenizer(corpus, vocab_size=vocab_size)
    hidden, layers, heads, kv, inter, vdepth, vhidden, vheads = SIZES[size]
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden // heads
    half = head_dim // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]  # mrope sections (t, h, w) sum to head_dim/2
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "max_position_embeddings": 32768, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                                "mrope_interleaved": True},
            "pad_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "depth": vdepth, "hidden_size": vhidden, "intermediate_size": 2 * vhidden, "num_heads": vheads,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": hidden,
            "num_position_embeddings": 256, "deepstack_visual_indexes": list(range(vdepth)),
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = None
    size_kw = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size=size_kw,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size=size_kw,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor, chat_template=CHAT_TEMPLATE
    )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
