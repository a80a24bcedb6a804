"""Decoder benchmark: 64-frame overview and 16-frame 20-second crop per backend.

Makes (or takes) a 10-minute and a 60-minute 640x360 30 fps H.264 video with the
encoder's default keyframe interval (x264: 250 frames), then prints, per backend,
the median time (each call opens the file: the decoder pool is cleared first) and
the ratio to decord's ``get_batch`` in the same run; PyAV with one decoder and with
``decode_workers`` (default: one per core). ``--baseline COMMIT`` also runs the
overview with that commit's code (``git archive``, a subprocess, same files, same
run): its time, the ratio, and whether frames and timestamps are identical.
``--long`` adds 10, 60 and 180-minute 320x180 videos: overview time against duration.

    python perf/bench_video.py [--minutes 10 60] [--repeat 3] [--videos a.mp4 b.mp4]
                               [--baseline 634e189] [--long]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from paravt_agent.video import POOL, VideoReader, available_backends, fit_size, overview_times
from paravt_train.toy.render import write_video

MEDIA = Path(__file__).parent / "media"


def make_video(minutes: int, width: int = 640, height: int = 360) -> Path:
    path = MEDIA / f"bench_{minutes}min_{width}x{height}_30fps.mp4"
    if path.exists():
        return path
    MEDIA.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(minutes)
    texture = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    tint = rng.integers(0, 256, (minutes * 3 + 1, 3))  # a new "scene" every 20 s

    def frame(i: int) -> np.ndarray:
        scene = i // 600
        img = np.roll(texture, shift=(i * 3) % width, axis=1).astype(np.int16)
        img = (img // 2 + tint[scene] // 2).astype(np.uint8)
        y, x, sq = height * 4 // 9, (i * 4) % (width - width // 16), width // 16
        img[y : y + sq, x : x + sq] = 255  # a moving square
        return img

    tmp = path.with_suffix(".part.mp4")
    t0 = time.time()
    print(f"encoding {path.name} ({minutes * 60 * 30} frames) ...", flush=True)
    write_video(tmp, minutes * 60 * 30, frame, fps=30, width=width, height=height)
    tmp.rename(path)
    print(f"  done in {time.time() - t0:.0f}s", flush=True)
    return path


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        POOL.clear()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def raw_decord(path: Path, which: str):
    import decord

    def run():
        vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=2)
        fps, n = vr.get_avg_fps(), len(vr)
        if which == "overview":
            times = overview_times(n / fps, max_frames=64)
        else:
            mid = n / fps / 2
            times = list(np.linspace(mid, mid + 20, 16))
        idx = [min(n - 1, int(t * fps)) for t in times]
        vr.get_batch(idx).asnumpy()

    return run


BASELINE = r"""
import pickle, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from paravt_agent.video import POOL, VideoReader
out = {}
for f in sys.argv[3:]:
    for fast in (False, True):
        times = []
        for _ in range(int(sys.argv[2])):
            POOL.clear(); t0 = time.perf_counter(); c = VideoReader(f).overview(fast_overview=fast)
            times.append(time.perf_counter() - t0)
        out[(f, fast)] = (statistics.median(times), c.frames, c.timestamps)
pickle.dump(out, sys.stdout.buffer)
"""


def baseline(commit: str, videos: list[Path], repeat: int) -> dict:
    """The overview (exact and keyframe) with ``commit``'s code, in a subprocess."""
    import pickle
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parent.parent
    tmp = tempfile.mkdtemp(prefix="paravt-baseline-")
    subprocess.run(f"git -C {root} archive {commit} paravt_agent tools | tar -x -C {tmp}", shell=True, check=True)
    out = subprocess.run([sys.executable, "-c", BASELINE, tmp, str(repeat), *map(str, videos)], capture_output=True,
                         check=True)
    return pickle.loads(out.stdout)


def long_videos(repeat: int) -> None:
    """Overview time against duration (320x180 30 fps, default keyframe interval)."""
    print("\noverview time against duration (320x180, 30 fps):")
    print(f"{'minutes':>8s} {'exact s':>8s} {'keyframes s':>12s}")
    for minutes in (10, 60, 180):
        path = make_video(minutes, 320, 180)
        r = VideoReader(path)
        print(f"{minutes:8d} {timed(lambda r=r: r.overview(), repeat):8.3f} "
              f"{timed(lambda r=r: r.overview(fast_overview=True), repeat):12.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=int, nargs="+", default=[10, 60])
    ap.add_argument("--videos", type=Path, nargs="*", help="use these files instead of generating")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="a commit whose decoding to compare against (git archive)")
    ap.add_argument("--long", action="store_true", help="also 10/60/180-minute low-resolution videos")
    args = ap.parse_args()
    videos = args.videos or [make_video(m) for m in args.minutes]
    backends = available_backends()
    for path in videos:
        info = VideoReader(path).info
        mid = info.duration / 2
        print(f"\n{path.name}: {info.duration / 60:.1f} min, {info.width}x{info.height} @ {info.fps:g} fps, "
              f"frames at {fit_size(info.height, info.width)}")
        rows = []
        if "decord" in backends:
            rows.append(("decord get_batch (raw, reference)", raw_decord(path, "overview"), raw_decord(path, "crop")))
        for b in backends:
            r = VideoReader(path, backend=b)
            if b == "pyav":
                for w in (1, 0):
                    tag = "1 decoder" if w == 1 else "decode_workers auto"
                    rows.append((f"pyav exact, {tag}", lambda r=r, w=w: r.overview(decode_workers=w),
                                 lambda r=r, m=mid, w=w: r.crop(m, m + 20, decode_workers=w)))
                    rows.append((f"pyav keyframes, {tag}", lambda r=r, w=w: r.overview(fast_overview=True,
                                                                                       decode_workers=w), None))
                continue
            rows.append((f"{b} exact", lambda r=r: r.overview(), lambda r=r, m=mid: r.crop(m, m + 20)))
            if b != "torchcodec":
                rows.append((f"{b} fast (keyframes)", lambda r=r: r.overview(fast_overview=True), None))
        results = [(name, timed(ov, args.repeat), timed(cr, args.repeat) if cr else None) for name, ov, cr in rows]
        ref_ov, ref_cr = (results[0][1], results[0][2]) if "decord" in backends else (None, None)
        print(f"{'backend':36s} {'overview s':>10s} {'x decord':>9s} {'crop s':>8s} {'x decord':>9s}")
        for name, ov, cr in results:
            ov_ratio = f"{ref_ov / ov:8.2f}x" if ref_ov else "-"
            cr_txt = f"{cr:8.3f}" if cr is not None else "       -"
            cr_ratio = f"{ref_cr / cr:8.2f}x" if (ref_cr and cr) else "        -"
            print(f"{name:36s} {ov:10.3f} {ov_ratio:>9s} {cr_txt} {cr_ratio:>9s}")
        if args.baseline:
            old = baseline(args.baseline, [path], args.repeat)
            print(f"\nagainst {args.baseline} (same file, this run):")
            for fast in (False, True):
                t_old, f_old, s_old = old[(str(path), fast)]
                POOL.clear()
                new = VideoReader(path).overview(fast_overview=fast)
                t_new = dict((n, ov) for n, ov, _ in results)[f"pyav {'keyframes' if fast else 'exact'}, "
                                                              "decode_workers auto"]
                same = s_old == new.timestamps and np.array_equal(f_old, new.frames)
                print(f"  {'keyframes' if fast else 'exact':9s} {args.baseline} {t_old:.3f}s, now {t_new:.3f}s: "
                      f"{t_old / t_new:.2f}x faster; frames and timestamps {'identical' if same else 'DIFFER'}"
                      + (f"; now {ref_ov / t_new:.2f}x decord" if ref_ov else ""))
    if args.long:
        long_videos(args.repeat)
    print("\n'x decord' = decord time / this time (higher is faster; >= 1 means no slower than decord).")


if __name__ == "__main__":
    main()
