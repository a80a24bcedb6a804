"""SFT throughput on the tiny model on CPU: tokens/s, samples/s and peak memory, full and LoRA.

    python perf/bench_sft.py [--steps 20] [--size test|toy]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, resource
from paravt_train.sft import train
from paravt_train.sft.config import SFTConfig
cfg = SFTConfig(**json.loads(sys.argv[1]))
t0 = time.perf_counter()
res = train(cfg, progress=False)
wall = time.perf_counter() - t0
rows = [json.loads(x) for x in open(cfg.output_dir + "/metrics.jsonl")]
steady = rows[2:] or rows
tok = sum(r["tokens"] for r in steady); secs = sum(r["step_time"] for r in steady)
print(json.dumps({"tokens_per_s": tok / secs, "samples_per_s": len(steady) * cfg.batch_size / secs,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "wall": wall}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", default="toy")
    args = ap.parse_args()
    from paravt_agent.prompts import TOOL_SYSTEM_PROMPT, question_text
    from paravt_train.data import write_parquet
    from paravt_train.toy.render import write_segments
    from paravt_train.toy.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = []
        for v in range(8):
            write_segments(tmp / f"v{v}.mp4", [((40 * v % 256, 200, 90), 3.0), ((200, 40, 40 * v % 256), 3.0)] * 5,
                           fps=4, width=32, height=32)
            rows.append({"messages": [
                {"role": "system", "content": TOOL_SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "video", "video": f"v{v}.mp4", "n_frames": 16},
                                             {"type": "text",
                                              "text": question_text("What colour is shown at 00:07?")}]},
                {"role": "assistant", "content": "<think>\nI should look at 00:05-00:09.</think>\n<tool_call>"
                 '{"name": "crop_video", "arguments": {"start_time": 5, "end_time": 9}}</tool_call>'},
            ]})
        write_parquet(rows, tmp / "d.parquet")
        model = build_tiny_model(tmp / "model", size=args.size)
        print(f"tiny model ({args.size}); 8 samples of 16 frames 32x32; batch 8, micro-batch 4; {args.steps} steps")
        print(f"{'variant':8s} {'tokens/s':>10s} {'samples/s':>10s} {'peak RSS MB':>12s}")
        for name, lora in (("full", {"enabled": False}), ("lora", {"enabled": True, "r": 8, "alpha": 16})):
            cfg = {"model": str(model), "data": str(tmp / "d.parquet"), "video_root": str(tmp),
                   "output_dir": str(tmp / name), "batch_size": 8, "micro_batch_size": 4, "max_steps": args.steps,
                   "save_every": 0, "save_final": False, "frames": {"max_pixels": 1024}, "lora": lora, "lr": 1e-3}
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"{name:8s} {r['tokens_per_s']:10.0f} {r['samples_per_s']:10.2f} {r['peak_rss_mb']:12.0f}")


if __name__ == "__main__":
    main()
