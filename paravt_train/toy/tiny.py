"""Build a tiny Qwen3-VL-architecture model offline: a locally trained byte-level BPE
tokenizer with the Qwen special tokens, a Qwen3-VL chat template, a real
``Qwen3VLProcessor`` and randomly initialised weights, saved as an ordinary model
directory that ``transformers`` (``from_pretrained``, ``transformers serve``) loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from paravt_agent.prompts import (
    FINAL_ANSWER_PROMPT,
    NO_TOOL_SYSTEM_PROMPT,
    SUBAGENT_SYSTEM_PROMPT,
    TOOL_SYSTEM_PROMPT,
)
from paravt_train.toy.rows import random_listing

__all__ = ["CHAT_TEMPLATE", "NUMBER_TOKENS", "SIZES", "SPECIAL_TOKENS", "build_tiny_model", "copy_warmup",
           "train_tokenizer"]

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
#: Added tokens: one per whole number 0-255 ("17"), matched longest first ("127" is one token, not "12" + "7";
#: "1270" is "127" + "0"). Qwen's pre-tokenizer splits numbers into digits, so a time would be two or three
#: tokens, and copying it a match of several tokens (digits repeat) that a tiny model trained from scratch does
#: not learn. With these, a second is one token and the same one wherever it is written: in a frame label
#: ("<17.0 seconds>"), the question, a crop argument, a listing ("cyan ^17"), a finding and an answer ("[17,
#: 19]"); so every copy of a time is a one-token lookup. Added without a space on purpose: " 17" as one token
#: would not be the label's "17". On by default for the toy (``ToyConfig.number_tokens``; README, the toy world).
NUMBER_TOKENS = [str(i) for i in range(256)]

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

    lines = [TOOL_SYSTEM_PROMPT, NO_TOOL_SYSTEM_PROMPT, SUBAGENT_SYSTEM_PROMPT, FINAL_ANSWER_PROMPT]
    lines += [f"<{t:.1f} seconds> {t} {t:02d}:{t % 60:02d}" for t in range(0, 400)]
    lines += ['{"name": "crop_video", "arguments": {"start_time": 12, "end_time": 20}}', "<answer>B</answer>"]
    return lines


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048, number_tokens: bool = False):
    """Byte-level BPE trained on ``corpus`` (plus the protocol text), wrapped as a ``Qwen2Tokenizer``; with
    ``number_tokens``, one added token per whole number 0-255 (:data:`NUMBER_TOKENS`)."""
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
    if number_tokens:
        qt.add_tokens(NUMBER_TOKENS)
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
    number_tokens: bool = False,
) -> Path:
    """Write tokenizer, processor and a randomly initialised Qwen3-VL model to ``out_dir`` (``number_tokens``:
    see :func:`train_tokenizer`)."""
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
    tok = train_tokenizer(corpus, vocab_size=vocab_size, number_tokens=number_tokens)
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


def copy_vocabulary(tokenizer) -> list[str]:
    """The pieces copy rows are drawn from (``rows.copy_sample``): the text of every ordinary token (no
    bytes, no special or added tokens) that is printable ASCII, not only spaces, and free of digits and of
    the characters the protocol's tags and JSON use, so a random sequence of them never opens a tag or a
    tool call, and numbers (split into digits by the toy tokenizer) stay the traces' own. A tokenizer with
    number tokens (``NUMBER_TOKENS``, one per whole number) adds those: copying them is the one-token lookup
    the traces' copies of times then are."""
    import re

    out = []
    for i in range(256, tokenizer.vocab_size):
        text = tokenizer.decode([i])
        if text.strip() and text.isascii() and text.isprintable() and not re.search(r'[0-9<>|{}\[\]"\\]', text):
            out.append(text)
    # a tokenizer with number tokens: the numbers are pieces too (each one token, like the others)
    out += [t for t in NUMBER_TOKENS if t in tokenizer.added_tokens_encoder]
    return out


def copy_warmup(
    model_dir: str | Path,
    steps: int = 1500,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    length: tuple[int, int] = (20, 80),
    reach_steps: int = 0,
    reach_length: tuple[int, int] = (200, 800),
    listing_steps: int = 0,
    progress: bool = False,
    log=print,
) -> dict:
    """Teach a freshly initialised tiny model to copy, in place: the stand-in for pretraining. (One function
    on purpose: its phases share the model, optimizer and sample streams, and each reads as one loop.)

    Every sample is a random sequence of ordinary token ids followed by the same sequence again, with the
    loss on the repeat only, which can only be predicted by looking the current token up earlier in the
    context and copying what followed it (an *induction head*). Real base models bring that skill from
    pretraining; a tiny model trained from scratch on the toy traces never finds it from their few copies
    (one asked colour per grounding question). It forms in a sudden step, not gradually (``toy`` size,
    seed 0: copy accuracy 0.03 at step 800, 0.97 by step 1050). The toy SFT erases it within 200 steps
    unless its mix keeps copy rows of arbitrary tokens (``rows.copy_sample``). Off by default in ``paravt-train toy``
    (``copy_steps``); README's toy section has what it did and did not fix.

    A copy reaches only as far back as the sequences it was learned on (20-80 tokens: 0.04 accuracy on
    200-300-token sequences), so ``reach_steps`` more steps extend it in two stages: a third at half of
    ``reach_length``, the rest at ``reach_length``, with batches cut to keep about the tokens per step of
    the first stage. Returns the losses and the copy accuracy on held-out sequences of the final length,
    before, after the first stage and after all.

    Random tokens rarely repeat, so their copy needs a one-token lookup only, and the model it gives copies
    the toy's own listings ("cyan 75; red 12; ...", 8 colours, 10 digits and separators that repeat) at
    0.01. ``listing_steps`` more steps copy random listings (``rows.random_listing``), a copy that must
    match several tokens back; ``accuracy_listings`` is measured on held-out listings at the end.
    """

    import random

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    low, high = 256, tok.vocab_size  # ordinary merged tokens: no bytes, no special or added tokens
    if high - low < 64:
        raise ValueError(f"copy_warmup: the tokenizer has too few ordinary tokens ({high - low})")
    rng = random.Random(seed)


    # with number tokens (NUMBER_TOKENS) a quarter of the pieces are numbers: copying a time is then the same
    # one-token lookup as copying any other token, and the number tokens' embeddings learn it here
    numbers = [i for i in (tok.added_tokens_encoder.get(t) for t in NUMBER_TOKENS) if i is not None]

    def piece(r: random.Random) -> int:
        if numbers and r.random() < 0.25:
            return r.choice(numbers)
        return r.randrange(low, high)

    def sample(r: random.Random, span: tuple[int, int] | None) -> list[int]:
        if span is None:  # a random listing
            return tok(" " + random_listing(r) + ".", add_special_tokens=False)["input_ids"]
        return [piece(r) for _ in range(r.randint(*span))]

    def batch(seqs: list[list[int]]):
        width = 2 * max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            n = len(s)
            ids[i, : 2 * n] = torch.tensor(s + s)
            labels[i, n + 1 : 2 * n] = torch.tensor(s[1:])  # the repeat's first token has nothing to copy from
            mask[i, : 2 * n] = 1
        return ids, labels, mask

    final = reach_length if reach_steps else length
    held = [sample(random.Random(10_000_000 + seed + i), final) for i in range(32)]
    held_listings = [sample(random.Random(20_000_000 + seed + i), None) for i in range(32)]

    @torch.no_grad()
    def accuracy(seqs=held) -> float:
        model.eval()
        got_all, n_all = 0, 0
        for k in range(0, len(seqs), 8):
            ids, labels, mask = batch(seqs[k : k + 8])
            pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
            target, got = labels[:, 1:], pred[:, :-1]
            keep = target != -100
            got_all += int((got[keep] == target[keep]).sum())
            n_all += int(keep.sum())
        model.train()
        return got_all / max(n_all, 1)

    half = (max(2, reach_length[0] // 2), max(2, reach_length[1] // 2))
    stages = [(steps, length, batch_size)]
    if reach_steps:
        for span, n in ((half, reach_steps // 3), (reach_length, reach_steps - reach_steps // 3)):
            stages.append((n, span, max(2, round(batch_size * length[1] / span[1] * 2))))
    if listing_steps:
        stages.append((listing_steps, None, batch_size))
    before, listings_before = accuracy(), accuracy(held_listings)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    losses, after_first = [], None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(n for n, _, _ in stages), desc="copy warm-up", unit="step")
    model.train()
    for n, span, bs in stages:
        for _ in range(n):
            ids, labels, mask = batch([sample(rng, span) for _ in range(bs)])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if bar is not None:
                bar.update()
        if after_first is None and (reach_steps or listing_steps):
            after_first = accuracy()
            log(f"copy warm-up: {n} steps on {span[0]}-{span[1]} tokens; accuracy on {final[0]}-{final[1]} "
                f"tokens {before:.2f} -> {after_first:.2f}")
    if bar is not None:
        bar.close()
    after, listings_after = accuracy(), accuracy(held_listings)
    model.save_pretrained(model_dir)
    log(f"copy warm-up: {len(losses)} steps, copy accuracy on {final[0]}-{final[1]} tokens {before:.2f} -> "
        f"{after:.2f}, on listings {listings_before:.2f} -> {listings_after:.2f}")
    return {"losses": losses, "accuracy_before": before, "accuracy_first_stage": after_first, "accuracy_after": after,
            "accuracy_listings_before": listings_before, "accuracy_listings": listings_after}
