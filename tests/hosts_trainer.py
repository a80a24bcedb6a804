"""A trainer on another host of ``tests/test_hosts.py``'s bed: it pushes the toy policy (its first weight moved by
``--shift``) to an SGLang endpoint with ``sync.via distributed`` (gloo), and can misbehave as a real one does.

    hosts_trainer.py URL MASTER_ADDR MASTER_PORT VERSION [--shift X] [--stall-at N] [--sleep-at-half S]

``--stall-at N``: stop for good inside the N-th broadcast, after the server has posted its receives for that
bucket (it prints ``STALLED``: the test then kills this host's process or cuts the host off the network).
``--sleep-at-half S``: sleep S seconds half-way through the parameter stream, generation paused (a slow push: the
server's supervisor may continue generation meanwhile). Prints each line the sync logs (``LOG ...``) and a last
JSON line: ``{"result": ...}`` or ``{"error": ...}``.
"""

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("master_address")
    ap.add_argument("master_port", type=int)
    ap.add_argument("version")
    ap.add_argument("--shift", type=float, default=0.0)
    ap.add_argument("--stall-at", type=int, default=None)
    ap.add_argument("--sleep-at-half", type=float, default=0.0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText

    from paravt_train.sync.distributed import SGLangDistributedSync
    from paravt_train.sync.streamed import stream_parameters

    model = AutoModelForImageTextToText.from_pretrained(os.environ["PARAVT_HOSTS_MODEL"], dtype=torch.float32)
    with torch.no_grad():
        next(iter(model.parameters())).add_(args.shift)
    calls = {"n": 0}
    broadcast = dist.broadcast

    def stalling(tensor, *a, **kw):
        calls["n"] += 1
        if calls["n"] == args.stall_at:
            print("STALLED", flush=True)
            time.sleep(3600)
        return broadcast(tensor, *a, **kw)

    dist.broadcast = stalling
    named = list(stream_parameters(model))

    def stream():
        for i, item in enumerate(named):
            if args.sleep_at_half and i == len(named) // 2:
                print("SLEEPING", flush=True)
                time.sleep(args.sleep_at_half)
            yield item

    sync = SGLangDistributedSync(args.url, master_address=args.master_address, master_port=args.master_port,
                                 backend="gloo", device="cpu", bucket_bytes=1 << 20, timeout=120,
                                 log=lambda m: print("LOG", m, flush=True))
    try:
        print(json.dumps({"result": sync.send_tensors(stream, version=args.version)}), flush=True)
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    main()
