"""Which copies a toy policy can make: random tokens, or the toy's own listings.

    .venv/bin/python examples/toy_copy_probe.py MODEL                      # measure only (seconds)
    .venv/bin/python examples/toy_copy_probe.py MODEL --steps 3000         # and train on copies (8 min on 2 cores)
    .venv/bin/python examples/toy_copy_probe.py MODEL --steps 4000 --listing-share 1.0

Every sample is a sequence followed by itself, scored on the repeat (next-token accuracy on 32 held-out
sequences of each kind):

* random tokens: 20-80 ordinary tokens drawn uniformly (what ``tiny.copy_warmup`` teaches); a token
  rarely repeats, so looking up the current token and copying what followed it is enough;
* listings: 4-16 random toy entries ("cyan 75; red 12; ..."), the pieces the grounding sub-agents and
  answer step copy; the same 8 colours, 10 digits and separators repeat, so the copy must match several
  tokens back, not one.

With ``--steps`` it then trains the model (text only, lr 1e-3, batch 16, a ``--listing-share`` of the
samples listings, the rest random tokens) and prints both accuracies every 250 steps; nothing is saved.
README, the toy world, has what it measured.
"""

from __future__ import annotations

import argparse
import random
import time

COLOURS = ["red", "green", "yellow", "blue", "orange", "purple", "cyan", "white"]


def main() -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a toy model directory (a policy, or a warm-up's init)")
    ap.add_argument("--steps", type=int, default=0, help="training steps on copies (0: measure only)")
    ap.add_argument("--listing-share", type=float, default=0.5, help="share of listing copies in training")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not 0.0 <= args.listing_share <= 1.0:
        ap.error("--listing-share must be between 0 and 1")

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)

    def listing(r: random.Random) -> list[int]:
        entries = [f"{r.choice(COLOURS)} {r.randrange(128)}" for _ in range(r.randint(4, 16))]
        return tok(" " + "; ".join(entries) + ".", add_special_tokens=False)["input_ids"]

    def tokens(r: random.Random) -> list[int]:
        return [r.randrange(256, tok.vocab_size) for _ in range(r.randint(20, 80))]

    def batch(seqs):
        width = 2 * max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            n = len(s)
            ids[i, : 2 * n] = torch.tensor(s + s)
            labels[i, n + 1 : 2 * n] = torch.tensor(s[1:])
            mask[i, : 2 * n] = 1
        return ids, labels, mask

    held = {"listings": [listing(random.Random(10**7 + i)) for i in range(32)],
            "random tokens": [tokens(random.Random(2 * 10**7 + i)) for i in range(32)]}

    @torch.no_grad()
    def accuracy(seqs) -> float:
        model.eval()
        got = total = 0
        for k in range(0, len(seqs), 8):
            ids, labels, mask = batch(seqs[k : k + 8])
            pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
            target, guess = labels[:, 1:], pred[:, :-1]
            keep = target != -100
            got += int((guess[keep] == target[keep]).sum())
            total += int(keep.sum())
        model.train()
        return got / total

    def report(prefix: str) -> None:
        print(prefix + ", ".join(f"{k} copy {accuracy(v):.2f}" for k, v in held.items()), flush=True)

    report("start: ")
    if not args.steps:
        return
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng, t0 = random.Random(args.seed), time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        seqs = [listing(rng) if rng.random() < args.listing_share else tokens(rng) for _ in range(16)]
        ids, labels, mask = batch(seqs)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 250 == 0:
            report(f"step {step} ({time.perf_counter() - t0:.0f} s, loss {loss.item():.3f}): ")


if __name__ == "__main__":
    main()
