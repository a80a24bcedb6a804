"""A stand-in for an SGLang server: SGLang 0.5.23's HTTP API, backed by a real (tiny) Qwen3-VL on CPU.

    python tests/sglang_server.py --model DIR --port P [--enable-deterministic-inference]
                                  [--sampling-defaults model|openai] [--tp-size N] [--dp-size N]
                                  [--api-key KEY] [--admin-api-key KEY]

Shared by every test that needs a model server (policy, RL, weight sync, online learning, the router) and by
the online-learning example. **Checked by SGLang's own contract**: every ``/generate`` body is validated with
``GenerateRequest.from_json_value`` and every reply is built from ``GenerateResponse`` / ``GenerateMetaInfo``
(``/model_info``, ``/server_info`` from their response types), all from ``sglang/api/v1/api_types.py`` of the
pinned SGLang wheel (``make sglang-contract`` fetches it into ``.sglang-contract/``; the version is named once,
in the Makefile). A field SGLang refuses is refused here with SGLang's own message, and a reply SGLang could not
produce fails the test that caused it.

Behaviour modelled on SGLang 0.5.23 (read from its source; ``../shared/FACTS.md`` names the files):

* ``POST /generate`` — ``input_ids`` + ``image_data`` (base64): multimodal ids are used **verbatim**, each image
  placeholder expanded to the image's visual tokens by the model's own image processor (no decode → re-tokenise
  round trip since 0.5.21). ``return_prompt_token_ids`` puts the consumed (expanded) ids at the reply's top
  level. ``sampling_params``: temperature, top_p, top_k (-1 = all), min_p, repetition / frequency / presence
  penalties (on output tokens), max_new_tokens, stop (strings: generation ends and the text is trimmed unless
  ``no_stop_trim``), stop_token_ids, ignore_eos, skip_special_tokens, logit_bias (added after the penalties),
  sampling_seed (honoured only with ``--enable-deterministic-inference``). Unset sampling keys take SGLang's own
  defaults: ``/generate`` does not
  read the model's ``generation_config.json`` (SGLang 0.5.23 applies ``--sampling-defaults model`` to its OpenAI
  routes only; the flag is accepted here and changes nothing).
  Logprobs (``return_logprob``) are those of the distribution sampled from (penalties and logit_bias applied,
  temperature-scaled), as ``(logprob, id, None)`` entries; ``logprob_start_len`` >= 0 adds prompt logprobs.
* ``meta_info.weight_version`` is a **string**: ``"default"`` until an update names another; a request that
  spans an update gets ``weight_versions`` spans ``{version, start, end}`` over its output tokens.
* ``POST /pause_generation {"mode"}`` / ``/continue_generation``: ``abort`` ends running requests (finish
  reason ``abort``, the tokens so far returned); ``retract`` sends them back to the queue **keeping their
  tokens**: they continue on the new weights after ``continue``; ``in_place`` holds them where they are.
* Weight updates: ``/update_weights_from_disk`` {model_path, flush_cache, weight_version, ...};
  ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` only inside a session
  (``/begin_weight_update`` … ``/end_weight_update``, 400 outside one); ``/init_weights_update_group`` joins a
  ``torch.distributed`` group (gloo here) that ``/update_weights_from_distributed`` receives broadcasts over.
  A cache flush while requests are held by an ``in_place`` pause fails the call with HTTP 400 (0.5.22+: the
  weights are updated, the flush is refused); ``/flush_cache`` likewise.
* ``GET /health``, ``/ping``, ``/ready`` (503 while paused), ``/model_info``, ``/server_info`` (and the deprecated
  ``/get_model_info``, ``/get_server_info``).
  read: ``tp_size``, ``dp_size``, ``enable_deterministic_inference``, and, when ``SGLANG_EXPOSE_OWN_ENV_VARS`` is
  set, the ``SGLANG_*`` environment in ``internal_states[0].env_vars``.
* What takes SGLang down is modelled as a server that exits (every request in flight is lost): a tensor update
  with fewer payloads than ``--tp-size`` (``tp_worker`` opens ``payloads[tp_rank]``), and ``min_p > 0`` on a
  sampled request with deterministic inference (the seeded sampler's assertion). A tensor update with more
  payloads is recorded (``tensor_payloads``: SGLang leaves the extra CUDA-IPC handles unopened). The
  weight-update group has ``--tp-size`` ranks here (``rank_offset + tp_rank``; ``world_size`` too small is
  refused, as SGLang's failed join).
* ``--api-key`` / ``--admin-api-key``: SGLang 0.5.23's key check (``utils/auth.py``): ``/health*`` open; admin
  routes (pause, weight updates, flush, groups) take the admin key when set, else the API key; the others the
  API key; 401 otherwise.

Requests run one model step at a time under one lock (a CPU model: throughput is not the point); pauses take
effect between steps.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_DIR = ROOT / ".sglang-contract"


def load_contract():
    """``sglang/api/v1/api_types.py`` of the pinned SGLang wheel, as a module (``api.VERSION`` names it)."""
    path = CONTRACT_DIR / "api_types.py"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run `make sglang-contract` (it extracts SGLang's HTTP contract from "
                           "the pinned wheel)")
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.VERSION = (CONTRACT_DIR / "VERSION").read_text().strip()
    return mod


api = load_contract()


def die(why: str) -> None:
    """What an exception in SGLang's scheduler does: the whole server goes, every request in flight with it."""
    print(f"scheduler exception, the server exits: {why}", file=sys.stderr, flush=True)
    os._exit(1)


#: SGLang 0.5.23's auth levels (``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` in ``entrypoints/http_server.py``)
ADMIN_ROUTES = {"/pause_generation", "/continue_generation", "/update_weights_from_disk", "/begin_weight_update",
                "/end_weight_update", "/update_weights_from_tensor", "/init_weights_update_group",
                "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weight_version",
                "/flush_cache", "/load_lora_adapter", "/unload_lora_adapter"}


class _Abort(Exception):
    pass


class _Retract(Exception):
    pass


class Refused(Exception):
    """An HTTP 400 with a body."""

    def __init__(self, body: dict | str):
        super().__init__(str(body))
        self.body = body


class _Request:
    """A generation in flight: its output so far and the weight versions it saw."""

    def __init__(self, rid: str):
        self.rid = rid
        self.chosen: list[int] = []
        self.logprobs: list[float] = []
        self.events: list[tuple[str, int]] = []  # (version before an update, output tokens at the update)


class Engine:
    def __init__(self, model_dir: str, deterministic: bool = False, sampling_defaults: str = "model",
                 tp_size: int = 1, dp_size: int = 1):
        from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

        self.model_dir = model_dir
        self.deterministic = deterministic
        self.tp_size, self.dp_size = tp_size, dp_size
        self.tensor_payloads: list[int] = []  # the payload count of every tensor update (one per TP rank expected)
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tok = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config = GenerationConfig()  # SGLang samples with its own sampler, never HF's config
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.image_id = self.tok.convert_tokens_to_ids(self.processor.image_token)
        self.merge = int(getattr(self.processor.image_processor, "merge_size", 2))
        self.lock = threading.Lock()  # one model step at a time; weight updates take it too
        self.cv = threading.Condition()
        self.paused: str | None = None
        self.parked = 0  # running requests held at a step boundary by an in_place pause
        self.live: dict[str, _Request] = {}
        self.weight_version = "default"
        self.session: dict | None = None  # an open weight-update session
        self.groups: dict[str, list] = {}  # weight-update process groups by name: this server's rank per TP rank
        self.requests = 0
        self.started = time.time()

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

    def flush(self) -> bool:
        """SGLang's flush_cache: refused while requests are running (held by an in_place pause)."""
        with self.cv:
            return self.parked == 0

    def _set_version(self, version: str | None) -> None:
        """SGLang's record_weight_version_change: requests in flight remember where the old version ended."""
        if version is None or version == self.weight_version:
            return
        for req in list(self.live.values()):
            if req.chosen:
                req.events.append((self.weight_version, len(req.chosen)))
        self.weight_version = version

    def load_state(self, state: dict, version: str | None) -> None:
        with self.lock:
            own = self.model.state_dict()
            missing = [k for k in state if k not in own]
            if missing:
                raise Refused({"success": False, "message": f"Failed to update weights: unknown parameters "
                                                            f"{missing[:3]}"})
            with torch.no_grad():
                for k, v in state.items():
                    if tuple(v.shape) != tuple(own[k].shape):
                        raise Refused({"success": False,
                                       "message": f"Failed to update weights: {k} has shape "
                                                  f"{tuple(v.shape)}, expected {tuple(own[k].shape)}"})
                    own[k].copy_(v.to(own[k].dtype))
            self._set_version(version)

    def updated(self, body: dict, extra: dict | None = None) -> dict:
        """The reply of an update that loaded its weights: a refused flush makes it a 400 (0.5.22+)."""
        if body.get("flush_cache", True) and not self.flush():
            raise Refused({"success": False, "message": "Weights were updated, but the cache was not flushed because "
                                                        "requests are still running or queued. Retract or finish "
                                                        "them, then call /flush_cache.", **(extra or {})})
        return {"success": True, "message": "Succeeded to update model weights.", **(extra or {})}

    def update_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            raise Refused({"success": False, "message": f"Failed to update weights: no safetensors files in "
                                                        f"{body['model_path']}", "num_paused_requests": 0})
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        self.load_state(state, body.get("weight_version"))
        return self.updated(body, {"num_paused_requests": self.parked})

    def _in_session(self, what: str) -> None:
        if self.session is None:
            raise Refused({"success": False, "message": f"{what} must run between begin_weight_update() and "
                                                        "end_weight_update()"})

    def update_from_tensor(self, body: dict) -> dict:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - tensor reductions

        self._in_session("update_weights_from_tensor")
        payloads = body["serialized_named_tensors"]
        if not isinstance(payloads, list) or not payloads:
            raise Refused({"success": False, "message": "serialized_named_tensors must be a non-empty list"})
        self.tensor_payloads.append(len(payloads))
        if len(payloads) < self.tp_size:  # SGLang's tp_worker: payloads[tp_rank] raises in the scheduler
            die(f"IndexError: list index out of range (TP rank {len(payloads)} of {self.tp_size} has no payload)")
        named = ForkingPickler.loads(base64.b64decode(payloads[0]))  # rank 0's copy (tp_size copies are sent)
        self.load_state({k: v.clone() for k, v in named}, body.get("weight_version"))
        self.session["loaded"] = True
        self.session["tp_copies"] = len(payloads)
        return self.updated(body)

    def init_group(self, body: dict) -> dict:
        """Join the trainer's weight-update group as SGLang's ``init_custom_process_group`` does: a TCP rendezvous
        at master_address:master_port, the store prefixed by the group name, one rank per TP rank at
        ``rank_offset + tp_rank`` (gloo groups of this process's own, one per rank, joined side by side)."""
        import datetime

        from torch.distributed.distributed_c10d import PrefixStore, rendezvous

        backend = body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise Refused({"success": False, "message": "Failed to init group: nccl needs a GPU (use gloo on CPU)"})
        name = body.get("group_name", "weight_update_group")
        offset, world = int(body["rank_offset"]), int(body["world_size"])
        if offset + self.tp_size > world:
            raise Refused({"success": False, "message": f"Failed to init group: rank {offset + self.tp_size - 1} "
                                                        f"(TP rank {self.tp_size - 1}) is outside world_size {world}"})
        timeout = datetime.timedelta(seconds=120)
        url = f"tcp://{body['master_address']}:{int(body['master_port'])}"
        ranks: list = [None] * self.tp_size
        errors: list = []

        def join(r: int) -> None:
            try:
                store, rank, size = next(rendezvous(url, offset + r, world, timeout=timeout))
                store.set_timeout(timeout)
                prefixed = PrefixStore("cpu/", PrefixStore(f"{name}/", PrefixStore(name, store)))
                ranks[r] = torch.distributed.ProcessGroupGloo(prefixed, rank, size, timeout)
            except Exception as exc:  # noqa: BLE001 (answered below)
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(self.tp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise Refused({"success": False, "message": f"Failed to init group: {errors[0]}"})
        self.groups[name] = ranks
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        if self.groups.pop(name, None) is None:
            raise Refused({"success": False, "message": f"Failed to destroy group: group {name} does not exist"})
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_from_distributed(self, body: dict) -> dict:
        import torch.distributed as dist

        self._in_session("update_weights_from_distributed")
        ranks = self.groups.get(body.get("group_name", "weight_update_group"))
        if ranks is None:
            raise Refused({"success": False, "message": "Failed to receive weights: no such group; call "
                                                        "/init_weights_update_group first"})
        received: list[dict] = [{} for _ in ranks]

        def receive(r: int) -> None:  # every TP rank receives each tensor (its own copy)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")))
                ranks[r].broadcast([t], opts).wait()
                received[r][name] = t

        threads = [threading.Thread(target=receive, args=(r,), daemon=True) for r in range(len(ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(len(got) != len(body["names"]) for got in received):
            raise Refused({"success": False, "message": "Failed to receive weights: a broadcast failed"})
        self.load_state(received[0], body.get("weight_version"))
        self.session["loaded"] = True
        return self.updated(body)

    # ------------------------------------------------------------------ generation

    def _inputs(self, input_ids: list[int], image_data: list[str] | None) -> dict:
        """The model's inputs for verbatim ids: each image placeholder expanded to the image's visual tokens."""
        if not image_data:
            ids = torch.tensor([input_ids])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        from PIL import Image

        images = [Image.open(io.BytesIO(base64.b64decode(x))).convert("RGB") for x in image_data]
        enc = self.processor.image_processor(images=images, return_tensors="pt")
        grids = enc["image_grid_thw"].tolist()
        expanded, k = [], 0
        for t in input_ids:
            if t == self.image_id:
                if k >= len(grids):
                    raise Refused({"error": f"more image placeholders than the {len(grids)} images sent"})
                t_, h, w = grids[k]
                expanded.extend([t] * (t_ * h * w // (self.merge * self.merge)))
                k += 1
            else:
                expanded.append(t)
        if k != len(grids):
            raise Refused({"error": f"{len(grids)} images but {k} image placeholders in input_ids"})
        ids = torch.tensor([expanded])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": enc["pixel_values"],
                "image_grid_thw": enc["image_grid_thw"], "mm_token_type_ids": (ids == self.image_id).long()}

    def input_logprobs(self, inputs: dict, start: int, temperature: float) -> list:
        with self.lock, torch.no_grad():
            logits = self.model(**inputs, use_cache=False).logits[0].float()
        ids = inputs["input_ids"][0]
        lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(1, ids[1:, None])[:, 0].tolist()
        rows = [api.LogprobEntry(logprob=None, token_id=int(ids[0]))]
        rows += [api.LogprobEntry(logprob=float(v), token_id=int(t)) for v, t in zip(lp, ids[1:].tolist(), strict=True)]
        return rows[start:]

    def generate(self, body: dict) -> dict:
        req = api.GenerateRequest.from_json_value(body)  # SGLang's contract: a violation is a 400
        if req.input_ids is None or (req.input_ids and isinstance(req.input_ids[0], list)):
            raise Refused({"error": "this test server takes one request of input_ids"})
        params = req.sampling_params or api.SamplingParams()
        if isinstance(params, list):
            raise Refused({"error": "this test server takes one sampling_params object"})

        def opt(name):  # SGLang's default for a key the request did not set (never generation_config.json's)
            return getattr(params, name)

        temperature, top_p, min_p = float(opt("temperature")), float(opt("top_p")), float(opt("min_p"))
        if self.deterministic and min_p > 0 and temperature > 0:  # SGLang's seeded sampler asserts in the scheduler
            die("AssertionError: With sampling seed, multinomial_with_seed will provide wrong results")
        top_k = int(opt("top_k"))
        penalties = (float(opt("repetition_penalty")), float(params.frequency_penalty),
                     float(params.presence_penalty))
        max_new = int(params.max_new_tokens if params.max_new_tokens is not None else 128)
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        stop_ids = set(params.stop_token_ids or []) | (set() if params.ignore_eos else {self.eos})
        seed = params.sampling_seed if self.deterministic else None
        bias = {int(k): float(v) for k, v in (params.logit_bias or {}).items()}  # added after the penalties
        image_data = req.image_data
        if isinstance(image_data, str):
            image_data = [image_data]
        inputs = self._inputs(list(req.input_ids), image_data)
        n_prompt = int(inputs["input_ids"].shape[1])
        rid = f"req{self.requests}"
        self.requests += 1
        scale = temperature if temperature > 0 else 1.0
        input_lps = None
        start = -1 if req.logprob_start_len is None else int(req.logprob_start_len)
        if req.return_logprob and start >= 0:
            input_lps = self.input_logprobs(inputs, start, scale)
        state = _Request(rid)
        reason: object = api.FinishLength(length=max_new)
        if max_new > 0:
            with self.cv:
                self.live[rid] = state
            try:
                while True:
                    self._wait_unpaused()
                    try:
                        reason = self._sample(inputs, state, temperature, top_p, top_k, min_p, penalties, max_new,
                                              stops, stop_ids, seed, bias)
                        break
                    except _Retract:  # back to the queue, tokens kept: continue on the new weights
                        continue
            finally:
                with self.cv:
                    self.live.pop(rid, None)
        ids, lps = state.chosen, state.logprobs
        skip = params.skip_special_tokens is not False
        body_ids = ids[:-1] if ids and ids[-1] in stop_ids and not params.no_stop_trim else ids
        text = self.tok.decode(body_ids, skip_special_tokens=skip)
        if isinstance(reason, api.FinishStop) and isinstance(reason.matched, str) and not params.no_stop_trim:
            cut = text.find(reason.matched)
            text = text[:cut] if cut >= 0 else text
        spans = _spans(state.events, self.weight_version, len(ids))
        meta = api.GenerateMetaInfo(
            id=rid, prompt_tokens=n_prompt, completion_tokens=len(ids), finish_reason=reason,
            output_token_logprobs=([api.LogprobEntry(logprob=float(v), token_id=int(t)) for v, t in
                                    zip(lps, ids, strict=True)] if req.return_logprob else None),
            input_token_logprobs=input_lps, weight_version=spans[-1].version if spans else self.weight_version,
            weight_versions=spans if state.events else [], cached_tokens=0)
        reply = api.GenerateResponse(text=text, output_ids=list(ids), meta_info=meta,
                                     prompt_token_ids=(inputs["input_ids"][0].tolist()
                                                       if req.return_prompt_token_ids else None))
        return reply.to_json_value()

    def _sample(self, inputs, state: _Request, temperature, top_p, top_k, min_p, penalties, max_new, stops, stop_ids,
                seed, bias=None):
        """Generate into ``state`` (continuing the tokens it already has, as a retracted request does)."""
        from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria

        engine, lock = self, self.lock
        if state.chosen:  # a retracted request: its prompt is the old prompt + its own tokens so far
            extra = torch.tensor([state.chosen])
            inputs = {**inputs, "input_ids": torch.cat([inputs["input_ids"], extra], 1),
                      "attention_mask": torch.cat([inputs["attention_mask"], torch.ones_like(extra)], 1)}
            if "mm_token_type_ids" in inputs:
                inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], 1)
        left = max_new - len(state.chosen)
        gen = torch.Generator()
        gen.manual_seed(int(seed) + len(state.chosen) if seed is not None else int(torch.randint(0, 2**62, (1,))))
        rep, freq, pres = penalties
        flags: dict = {"done": False, "reason": api.FinishLength(length=max_new)}

        class Step(LogitsProcessor):
            def __call__(self, input_ids, scores):
                out = torch.full_like(scores, float("-inf"))
                out[0, engine.eos] = 0.0  # fed back only when nothing was chosen (the request is ending)
                if flags["done"]:
                    return out
                try:
                    engine._boundary(lock)
                except _Abort:
                    flags.update(done=True, reason=api.FinishAbort(message="Abort in waiting queue"))
                    return out
                row = scores[0].float().clone()
                if state.chosen and (rep != 1.0 or freq or pres):  # SGLang's penalisers: output tokens only
                    seen = torch.tensor(state.chosen)
                    counts = torch.zeros_like(row).index_add_(0, seen, torch.ones(len(seen)))
                    hit = counts > 0
                    if rep != 1.0:
                        row = torch.where(hit & (row < 0), row * rep, torch.where(hit, row / rep, row))
                    row = row - freq * counts - pres * hit.float()
                if bias:  # SGLang's logit_bias: added after the penalisers, before the temperature and the logprobs
                    row[list(bias)] += torch.tensor(list(bias.values()))
                scaled = row / (temperature if temperature > 0 else 1.0)
                logp = torch.log_softmax(scaled, -1)
                if temperature <= 0:
                    token = int(row.argmax())
                else:
                    r = scaled.clone()
                    if 0 < top_k < r.numel():
                        kth = torch.topk(r, top_k).values[-1]
                        r = r.masked_fill(r < kth, float("-inf"))
                    probs = torch.softmax(r, -1)
                    if min_p > 0:
                        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
                    if top_p < 1.0:
                        sp, order = probs.sort(descending=True)
                        drop = sp.cumsum(0) - sp > top_p
                        probs = probs.scatter(0, order, sp.masked_fill(drop, 0.0))
                    token = int(torch.multinomial(probs, 1, generator=gen))
                state.logprobs.append(float(logp[token]))
                state.chosen.append(token)
                out = torch.full_like(scores, float("-inf"))
                out[0, token] = 0.0  # generate feeds exactly this token back
                if token in stop_ids:
                    flags.update(done=True, reason=api.FinishStop(matched=token))
                elif stops:
                    tail = engine.tok.decode(state.chosen[-64:], skip_special_tokens=False)
                    hit_s = next((s for s in stops if s and s in tail), None)
                    if hit_s is not None:
                        flags.update(done=True, reason=api.FinishStop(matched=hit_s))
                if not flags["done"] and len(state.chosen) >= max_new:
                    flags.update(done=True, reason=api.FinishLength(length=max_new))
                return out

        class Done(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                return torch.tensor([flags["done"]])

        config = GenerationConfig(max_new_tokens=left + 1, do_sample=False, pad_token_id=self.tok.pad_token_id,
                                  eos_token_id=None)
        with self.lock, torch.no_grad():
            self.model.generate(**inputs, generation_config=config, logits_processor=LogitsProcessorList([Step()]),
                                stopping_criteria=[Done()])
        return flags["reason"]


def _spans(events: list[tuple[str, int]], current: str, n: int) -> list:
    """SGLang's compute_weight_version_spans: the output tokens each weight version produced."""
    spans: list[list] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    return [api.WeightVersionSpan(version=v, start=s, end=e) for v, s, e in spans]


def make_handler(engine: Engine, api_key: str | None = None, admin_api_key: str | None = None):
    import hmac

    def allowed(path: str, header: str | None) -> bool:  # SGLang's decide_request_auth
        if path.startswith(("/health", "/ready", "/metrics")):
            return True
        key = (admin_api_key or api_key) if path in ADMIN_ROUTES else api_key
        if not key:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token, key)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _authorised(self) -> bool:
            if allowed(self.path.split("?")[0], self.headers.get("Authorization")):
                return True
            n = int(self.headers.get("Content-Length", 0) or 0)
            if n:
                self.rfile.read(n)
            self._send(401, {"error": "Unauthorized"})
            return False

        def _send(self, status: int, data: dict | str) -> None:
            raw = (json.dumps(data) if not isinstance(data, str) else data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if not isinstance(data, str) else "text/plain")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def model_info(self) -> dict:
            return api.GetModelInfoResponse(
                model_path=engine.model_dir, served_model_name=engine.model_dir, tokenizer_path=engine.model_dir,
                is_generation=True, weight_version=engine.weight_version).to_json_value()

        def server_info(self) -> dict:
            host, port = self.server.server_address[:2]
            info = api.GetServerInfoResponse(model_path=engine.model_dir, served_model_name=engine.model_dir,
                                             tokenizer_path=engine.model_dir, version=api.VERSION, host=host,
                                             port=port).to_json_value()
            with engine.cv:
                live = [len(r.chosen) for r in engine.live.values()]
            if os.environ.get("SGLANG_EXPOSE_OWN_ENV_VARS", "").lower() in ("1", "true"):
                info["internal_states"] = [
                    {"env_vars": {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}}]
            return {**info, "served_requests": engine.requests, "enable_deterministic_inference": engine.deterministic,
                    "tp_size": engine.tp_size, "dp_size": engine.dp_size,
                    # this test server's own: tokens of the requests in flight, payloads of each tensor update
                    "running_output_tokens": live, "tensor_payloads": list(engine.tensor_payloads)}

        def do_GET(self):  # noqa: N802
            if not self._authorised():
                return
            if self.path in ("/health", "/health_generate"):
                self._send(200, {})
            elif self.path == "/ping":  # 0.5.23: 200 while healthy, paused or not (it takes the API key)
                self._send(200, {"status": "ok"})
            elif self.path == "/ready":  # 0.5.23: 503 while generation is paused
                self._send(503 if engine.paused is not None else 200, {"status": "paused" if engine.paused else "ok"})
            elif self.path in ("/model_info", "/get_model_info"):
                self._send(200, self.model_info())
            elif self.path in ("/server_info", "/get_server_info"):
                self._send(200, self.server_info())
            elif self.path == "/flush_cache":
                self.do_POST()
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            if not self._authorised():
                return
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                self._send(400, {"error": "the body is not JSON"})
                return
            try:
                path = self.path.split("?")[0]
                if path == "/generate":
                    self._send(200, engine.generate(body))
                elif path == "/pause_generation":
                    mode = body.get("mode", "abort")
                    if mode not in ("abort", "retract", "in_place"):
                        raise Refused({"detail": f"mode {mode!r}: one of abort, retract, in_place"})
                    engine.pause(mode)
                    self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
                elif path == "/continue_generation":
                    engine.resume()
                    self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif path == "/update_weights_from_disk":
                    self._send(200, engine.update_from_disk(body))
                elif path == "/begin_weight_update":
                    if engine.session is not None:
                        raise Refused({"success": False, "message": "a weight-update session is already open; call "
                                                                    "end_weight_update() first"})
                    engine.session = {"selector": body.get("selector", "all"), "loaded": False}
                    self._send(200, {"success": True, "message": "Success"})
                elif path == "/end_weight_update":
                    if engine.session is None:
                        raise Refused({"success": False, "message": "no weight-update session is open; call "
                                                                    "begin_weight_update() first"})
                    engine.session = None
                    self._send(200, {"success": True, "message": "Success"})
                elif path == "/update_weights_from_tensor":
                    self._send(200, engine.update_from_tensor(body))
                elif path == "/init_weights_update_group":
                    self._send(200, engine.init_group(body))
                elif path == "/destroy_weights_update_group":
                    self._send(200, engine.destroy_group(body))
                elif path == "/update_weights_from_distributed":
                    self._send(200, engine.update_from_distributed(body))
                elif path == "/update_weight_version":
                    with engine.lock:
                        engine._set_version(str(body["new_version"]))
                    self._send(200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                                     "new_version": body["new_version"]})
                elif path == "/flush_cache":
                    if not engine.flush():
                        raise Refused("Flush cache failed.\n")
                    self._send(200, "Cache flushed.\n")
                else:
                    self._send(404, {"detail": "Not Found"})
            except api.JsonContractError as exc:  # SGLang's /generate contract gate
                self._send(400, {"error": str(exc)})
            except Refused as exc:
                self._send(400, exc.body)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed body, as SGLang's validation answers it
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
    ap.add_argument("--sampling-defaults", choices=["model", "openai"], default="model")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--admin-api-key", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("SGLANG_STUB_THREADS", "1"))))
    engine = Engine(args.model, deterministic=args.enable_deterministic_inference,
                    sampling_defaults=args.sampling_defaults, tp_size=args.tp_size, dp_size=args.dp_size)
    srv = ThreadingHTTPServer((args.host, args.port), make_handler(engine, args.api_key, args.admin_api_key))
    srv.daemon_threads = True
    print(f"serving {args.model} on http://{args.host}:{args.port} (SGLang {api.VERSION} contract)", flush=True)
    t0 = time.time()
    try:
        srv.serve_forever()
    finally:
        print(f"stopped after {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
