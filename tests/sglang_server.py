"""A stand-in for an SGLang server: SGLang's documented HTTP API, backed by a real (tiny) Qwen3-VL on CPU.

    python tests/sglang_server.py --model DIR --port P [--enable-deterministic-inference]

Shared by the policy, RL, weight-sync and online-learning tests and by the online-learning example;
it implements what ParaVT relies on, with SGLang's semantics (read from its source; see
../shared/FACTS.md):

* ``POST /generate`` — ``input_ids`` (one ``<|image_pad|>`` per image) + ``image_data`` (base64 images)
  + ``sampling_params`` {temperature, top_p, top_k (-1 = all), max_new_tokens, stop, stop_token_ids,
  ignore_eos, skip_special_tokens, sampling_seed} + ``return_logprob`` / ``logprob_start_len``. For a multimodal
  request the ids are decoded to text and tokenised again, then the model's own processor expands the
  images (as SGLang does). Response: ``text``, top-level ``output_ids``, ``meta_info`` with
  ``prompt_tokens``, ``completion_tokens``, ``finish_reason`` {type: stop | length | abort},
  ``output_token_logprobs`` as (logprob, id, None) triples (temperature-scaled) and, with
  ``logprob_start_len`` >= 0, ``input_token_logprobs``. ``sampling_seed`` is honoured only with
  ``--enable-deterministic-inference``.
* ``POST /pause_generation {"mode": "abort" | "retract" | "in_place"}`` / ``POST /continue_generation``:
  running requests are ended with finish reason ``abort``, sent back to restart from scratch on
  ``continue`` (retract), or held where they are, cache kept (in_place).
* ``POST /update_weights_from_disk {"model_path", "flush_cache"}``,
  ``POST /update_weights_from_tensor {"serialized_named_tensors", "flush_cache"}``, ``POST /flush_cache``:
  a cache flush while requests are still running (in_place pause) is what SGLang's scheduler asserts on;
  this server dies the same way (exit code 3), so a test sees the crash a real server would have.
* ``GET /health``, ``GET /get_model_info``.

Requests run one model step at a time under one lock (a CPU model: throughput is not the point);
pauses take effect between steps.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch


class _Abort(Exception):
    pass


class _Retract(Exception):
    pass


class Engine:
    def __init__(self, model_dir: str, deterministic: bool = False):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.model_dir = model_dir
        self.deterministic = deterministic
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tok = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.image_id = self.tok.convert_tokens_to_ids(self.processor.image_token)
        self.lock = threading.Lock()  # one model step at a time; weight updates take it too
        self.cv = threading.Condition()
        self.paused: str | None = None
        self.running = 0  # requests admitted and not finished
        self.parked = 0  # running requests held at a step boundary by a pause
        self.weight_version = 0
        self.requests = 0

    # ------------------------------------------------------------------ pause / continue

    def pause(self, mode: str) -> None:
        with self.cv:
            self.paused = mode
            self.cv.notify_all()
        with self.lock:  # the step in progress (if any) has finished; parked requests hold no lock
            pass

    def resume(self) -> None:
        with self.cv:
            self.paused = None
            self.cv.notify_all()

    def _boundary(self, hold_lock: threading.Lock) -> None:
        """Between two model steps: honour a pause (the model lock is released while parked)."""
        with self.cv:
            if self.paused is None:
                return
            mode = self.paused
        if mode == "abort":
            raise _Abort
        if mode == "retract":
            raise _Retract
        hold_lock.release()
        with self.cv:
            self.parked += 1
            while self.paused is not None:
                self.cv.wait()
            self.parked -= 1
        hold_lock.acquire()

    def _wait_unpaused(self) -> None:
        with self.cv:
            while self.paused is not None:
                self.cv.wait()

    # ------------------------------------------------------------------ weights

    def flush_check(self, flush: bool) -> None:
        with self.cv:
            busy = self.running if self.paused == "in_place" else 0
        if flush and busy:
            # SGLang: flush_cache() with running requests fails; in a weight update its scheduler asserts
            print(f"AssertionError: flush cache with {busy} running requests (pause mode in_place)", file=sys.stderr,
                  flush=True)
            os._exit(3)

    def load_state(self, state: dict) -> None:
        with self.lock:
            own = self.model.state_dict()
            missing = [k for k in state if k not in own]
            if missing:
                raise ValueError(f"unknown parameters {missing[:3]}")
            with torch.no_grad():
                for k, v in state.items():
                    own[k].copy_(v.to(own[k].dtype))
            self.weight_version += 1

    def update_from_disk(self, path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no safetensors files in {path}")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        self.load_state(state)

    # ------------------------------------------------------------------ generation

    def _inputs(self, input_ids: list[int], image_data: list[str] | None) -> dict:
        if not image_data:
            ids = torch.tensor([input_ids])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        from PIL import Image

        images = [Image.open(io.BytesIO(base64.b64decode(x))).convert("RGB") for x in image_data]
        text = self.tok.decode(input_ids, skip_special_tokens=False)  # SGLang: ids -> text -> tokens again
        enc = self.processor(text=[text], images=images, return_tensors="pt")
        out = {k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw") if k in enc}
        if "mm_token_type_ids" in enc:
            out["mm_token_type_ids"] = enc["mm_token_type_ids"]
        return out

    def input_logprobs(self, inputs: dict, start: int, temperature: float) -> list:
        with self.lock, torch.no_grad():
            logits = self.model(**inputs, use_cache=False).logits[0].float()
        ids = inputs["input_ids"][0]
        lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(1, ids[1:, None])[:, 0].tolist()
        rows = [[None, int(ids[0]), None]] + [[float(v), int(t), None] for v, t in zip(lp, ids[1:].tolist(), strict=True)]
        return rows[start:]

    def generate(self, body: dict) -> dict:
        params = body.get("sampling_params") or {}
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        max_new = int(params.get("max_new_tokens", 128))
        stops = list(params.get("stop") or [])
        stop_ids = set(params.get("stop_token_ids") or []) | (set() if params.get("ignore_eos") else {self.eos})
        seed = params.get("sampling_seed") if self.deterministic else None
        inputs = self._inputs(list(body["input_ids"]), body.get("image_data"))
        n_prompt = int(inputs["input_ids"].shape[1])
        meta = {"id": f"req{self.requests}", "prompt_tokens": n_prompt, "cached_tokens": 0,
                "weight_version": self.weight_version}
        self.requests += 1
        scale = temperature if temperature > 0 else 1.0
        if body.get("return_logprob") and int(body.get("logprob_start_len", -1)) >= 0:
            meta["input_token_logprobs"] = self.input_logprobs(inputs, int(body["logprob_start_len"]), scale)
        if max_new == 0:
            meta.update(completion_tokens=0, finish_reason={"type": "length", "length": 0}, output_token_logprobs=[])
            return {"text": "", "output_ids": [], "meta_info": meta}
        with self.cv:
            self.running += 1
        try:
            while True:
                self._wait_unpaused()
                try:
                    ids, lps, reason = self._sample(inputs, temperature, top_p, top_k, max_new, stops, stop_ids, seed,
                                                    scale)
                    break
                except _Retract:  # back to the queue: start again on the new weights
                    continue
        finally:
            with self.cv:
                self.running -= 1
        skip = params.get("skip_special_tokens", True)
        text = self.tok.decode(ids[:-1] if ids and ids[-1] in stop_ids and skip else ids, skip_special_tokens=skip)
        meta.update(completion_tokens=len(ids), finish_reason=reason,
                    output_token_logprobs=[[float(v), int(t), None] for v, t in zip(lps, ids, strict=True)])
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _sample(self, inputs, temperature, top_p, top_k, max_new, stops, stop_ids, seed, scale):
        from transformers import LogitsProcessor, LogitsProcessorList

        gen = torch.Generator()
        gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,))))
        chosen, lps = [], []
        engine = self
        lock = self.lock
        aborted = {"flag": False}

        class Step(LogitsProcessor):
            def __call__(self, input_ids, scores):
                row = scores[0].float()
                try:
                    engine._boundary(lock)
                except _Abort:
                    aborted["flag"] = True
                    out = torch.full_like(scores, float("-inf"))
                    out[0, engine.eos] = 0.0
                    return out
                if temperature <= 0:
                    token = int(row.argmax())
                else:
                    r = row / temperature
                    if top_k and top_k > 0:
                        kth = torch.topk(r, min(top_k, r.numel())).values[-1]
                        r = r.masked_fill(r < kth, float("-inf"))
                    probs = torch.softmax(r, -1)
                    if top_p < 1.0:
                        sp, order = probs.sort(descending=True)
                        drop = sp.cumsum(0) - sp > top_p
                        probs = probs.scatter(0, order, sp.masked_fill(drop, 0.0))
                    token = int(torch.multinomial(probs, 1, generator=gen))
                lps.append(float(torch.log_softmax(row / scale, -1)[token]))
                chosen.append(token)
                out = torch.full_like(scores, float("-inf"))
                out[0, token] = 0.0
                return out

        with self.lock, torch.no_grad():
            self.model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=0 if stop_ids else max_new,
                                do_sample=False, eos_token_id=sorted(stop_ids) or None,
                                pad_token_id=self.tok.pad_token_id, logits_processor=LogitsProcessorList([Step()]))
        if aborted["flag"]:
            n = len(lps)
            return chosen[:n], lps, {"type": "abort", "message": "Abort in waiting queue"}
        reason = {"type": "length", "length": max_new}
        for k, t in enumerate(chosen):
            if t in stop_ids:
                chosen, lps = chosen[: k + 1], lps[: k + 1]
                reason = {"type": "stop", "matched": t}
                break
        if stops:
            text = self.tok.decode(chosen, skip_special_tokens=False)
            for s in stops:
                if s in text:
                    reason = {"type": "stop", "matched": s}
        return chosen, lps, reason


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/get_server_info":  # SGLang's has the server args; this test server's counts
                self._send(200, {"served_requests": engine.requests, "weight_version": engine.weight_version})
            elif self.path == "/get_model_info":
                self._send(200, {"model_path": engine.model_dir, "tokenizer_path": engine.model_dir,
                                 "is_generation": True, "weight_version": engine.weight_version})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                if self.path == "/generate":
                    self._send(200, engine.generate(body))
                elif self.path == "/pause_generation":
                    engine.pause(body.get("mode", "abort"))
                    self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
                elif self.path == "/continue_generation":
                    engine.resume()
                    self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif self.path == "/update_weights_from_disk":
                    engine.flush_check(bool(body.get("flush_cache", True)))
                    engine.update_from_disk(body["model_path"])
                    self._send(200, {"success": True, "message": "Succeeded to update model weights.",
                                     "num_paused_requests": engine.parked})
                elif self.path == "/update_weights_from_tensor":
                    engine.flush_check(bool(body.get("flush_cache", True)))
                    from multiprocessing.reduction import ForkingPickler

                    import torch.multiprocessing  # noqa: F401 - tensor reductions

                    named = ForkingPickler.loads(base64.b64decode(body["serialized_named_tensors"][0]))
                    engine.load_state({k: v.clone() for k, v in named})
                    self._send(200, {"success": True, "message": "Succeeded to update model weights."})
                elif self.path == "/flush_cache":
                    engine.flush_check(True)
                    self._send(200, {"message": "Cache flushed."})
                else:
                    self._send(404, {"error": "not found"})
            except Exception as exc:  # an error reply, as SGLang gives one
                self._send(400, {"success": False, "message": f"{exc.__class__.__name__}: {exc}"})

        def log_message(self, *a):
            pass

    return Handler


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("SGLANG_STUB_THREADS", "1"))))
    engine = Engine(args.model, deterministic=args.enable_deterministic_inference)
    srv = ThreadingHTTPServer((args.host, args.port), make_handler(engine))
    srv.daemon_threads = True
    print(f"serving {args.model} on http://{args.host}:{args.port}", flush=True)
    t0 = time.time()
    try:
        srv.serve_forever()
    finally:
        print(f"stopped after {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
