import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import math  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from paravt_train.toy.render import write_segments  # noqa: E402

PALETTE = [
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
]


def pytest_addoption(parser):
    parser.addoption("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="The dtype of the numerics a GPU changes: the local backend's weights and the trainers' "
                          "autocast, in the tests that take the `dtype` fixture (marked `dtype`). `make test` runs "
                          "those again with bfloat16, the dtype a GPU gets by default.")
    parser.addoption("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="The local backend's device in the tests that take the `device` fixture: auto (the "
                          "backend's own choice: the CPU for the tiny test models), cpu or cuda (the GPU runner).")


def pytest_configure(config):  # noqa: ARG001
    """SIGTERM ends the run as Ctrl-C does: every fixture's teardown runs (the real engines' servers, routers,
    PostgreSQL), none is left running by a harness's time limit (tests/gpu/plugin.py)."""
    from tests.gpu.plugin import interrupt_on_sigterm

    interrupt_on_sigterm()


@pytest.fixture(scope="session")
def dtype(pytestconfig) -> str:
    """The dtype the numerics under test run in (``--dtype``): the local backend's ``dtype`` and, for the
    trainers, ``bf16: "true"`` when it is bfloat16 (autocast, as on a GPU)."""
    return pytestconfig.getoption("--dtype")


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    """The local backend's device (``--device``)."""
    return pytestconfig.getoption("--device")


#: float32: the largest |logprob difference| each exactness claim allows (the claims' own numbers): one row batched
#: with others and the row alone (``batch``), a continued turn or a repeated prompt from cached KV and a plain prefill
#: (``reuse``), the backend's logprob and a re-scoring forward of the whole sequence (``rescore``), and the mean per
#: token between an in-process rollout and the GRPO update's scoring (``update``: the trainer's ``logprob_mismatch``).
FLOAT32_BOUND = {"batch": 1e-4, "reuse": 1e-5, "rescore": 1e-3, "update": 1e-3}
#: bfloat16: the logit error two computations may differ by, in units in the last place at the logits' scale. Two
#: paths that round their logits (and the hidden states under them) independently, on other kernels (a GPU's decode
#: and prefill, another batch's tiling), differ by a few ulps; 4 is the assumption the first GPU run will check (the
#: runner's report prints each measured difference beside its bound).
BF16_LOGIT_ULPS = 4
#: bfloat16 keeps 8 significant bits
BF16_BITS = 8


def bf16_ulp(scale: float) -> float:
    """One unit in the last place of bfloat16 at ``scale``: 2^(⌊log2 scale⌋ − 7)."""
    return 2.0 ** (math.floor(math.log2(max(abs(scale), 1e-30))) - (BF16_BITS - 1))


class NumericBound:
    """The largest logprob difference an exactness claim of kind ``kind`` allows, by dtype.

    float32: :data:`FLOAT32_BOUND` (the claims' own numbers). bfloat16, from the dtype's resolution at the logits'
    scale s (the largest |logit| of the model, :func:`logit_scale`): a token's logprob is log p_c = z_c − LSE(z), so
    logit errors δ move it by δ_c − Σ_j p_j δ_j = Σ_j p_j (δ_c − δ_j), at most 2·max|δ|·(1 − p_c). With max|δ| =
    :data:`BF16_LOGIT_ULPS` ulp(s)::

        bound(log p) = 2 · 4 · 2^(⌊log2 s⌋ − 7) · (1 − p) + the float32 bound

    A confident token (p → 1) is insensitive to its logits' rounding; a near-tie (p ≈ ½) moves by up to 4 ulps. For
    a mean over tokens (``update``) 1 − p is the tokens' mean (``mismatch/uncertainty`` of the trainer's metrics)."""

    def __init__(self, kind: str, dtype: str, scale: float | None = None):
        self.kind, self.dtype, self.scale = kind, dtype, scale
        self.exact = dtype == "float32"
        if not self.exact and scale is None:
            raise ValueError("a bfloat16 bound needs the logits' scale")

    def at(self, logprob: float = math.log(0.5)) -> float:
        """The bound for a token of logprob ``logprob`` (for a mean: the log of the tokens' mean p)."""
        if self.exact:
            return FLOAT32_BOUND[self.kind]
        return 2 * BF16_LOGIT_ULPS * bf16_ulp(self.scale) * (1 - math.exp(min(logprob, 0.0))) + FLOAT32_BOUND[self.kind]

    def formula(self) -> str:
        if self.exact:
            return f"float32: {FLOAT32_BOUND[self.kind]:g}"
        return (f"bf16: 2·{BF16_LOGIT_ULPS}·ulp(s={self.scale:.3g})·(1−p) + {FLOAT32_BOUND[self.kind]:g}, "
                f"ulp {bf16_ulp(self.scale):g}")

    def check(self, record_property, measured: float, worst_bound: float | None = None) -> None:
        """Record the measured difference beside the bound (the GPU runner's report prints both) and the formula."""
        bound = self.at() if worst_bound is None else worst_bound
        record_property(f"{self.kind}_measured", f"{measured:.3g}")
        record_property(f"{self.kind}_bound", f"{bound:.3g}")
        record_property(f"{self.kind}_formula", self.formula())


@pytest.fixture(scope="session")
def logit_scale():
    """``logit_scale(model_dir)``: the largest |logit| of a model over a 48-token greedy turn from a fixed text prompt
    (float32, CPU), cached per directory: the scale its bf16 logits are rounded at (:class:`NumericBound`)."""
    seen: dict[str, float] = {}

    def measure(model_dir) -> float:
        key = str(model_dir)
        if key not in seen:
            import torch
            from transformers import AutoModelForImageTextToText, AutoProcessor

            model = AutoModelForImageTextToText.from_pretrained(key, dtype=torch.float32).eval()
            tok = AutoProcessor.from_pretrained(key).tokenizer
            ids = tok("<|im_start|>user\nWhat colour is shown at second 12?<|im_end|>\n<|im_start|>assistant\n"
                      "<think>\n", return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
            seen[key] = float(torch.stack(out.logits).abs().max())
        return seen[key]

    return measure


@pytest.fixture(scope="session")
def numeric_bound(dtype, logit_scale):
    """``numeric_bound(kind, model_dir)``: the :class:`NumericBound` of an exactness claim for ``dtype`` (bf16: at
    that model's logit scale)."""

    def make(kind: str, model_dir=None) -> NumericBound:
        if dtype == "float32":
            return NumericBound(kind, dtype)
        return NumericBound(kind, dtype, logit_scale(model_dir))

    return make


def assert_same_tokens(got_ids, got_lps, want_ids, want_lps, bound: NumericBound) -> tuple[float, float]:
    """Two runs of one row agree: float32, the same tokens and every logprob within its bound. bfloat16: the same
    tokens up to a near-tie — where they first differ, both runs' chosen tokens had logprobs within the bound of each
    other (an argmax flipped by rounding, not another distribution) — and every logprob before it within the bound
    at that token's probability. Returns the largest difference compared and the largest bound it was held to."""
    common = min(len(got_ids), len(want_ids))
    n = next((i for i in range(common) if got_ids[i] != want_ids[i]), common)
    if bound.exact or n == common:
        assert got_ids == want_ids
    upto = min(n + 1, common)
    worst = held = 0.0
    for i in range(upto):
        b = bound.at(max(got_lps[i], want_lps[i]))
        diff = abs(got_lps[i] - want_lps[i])
        assert diff <= b, (i, got_lps[i], want_lps[i], b, bound.formula())
        worst, held = max(worst, diff), max(held, b)
    return worst, held


@pytest.fixture(scope="session")
def media(tmp_path_factory):
    """Real mp4 files made once per session."""
    d = tmp_path_factory.mktemp("media")
    # 40 s, 30 fps, 96x64, a new colour every 2 s, keyframe every 30 frames (1 s)
    segs = [(PALETTE[i % len(PALETTE)], 2.0) for i in range(20)]
    return {
        "dir": d,
        "segments": segs,
        "video": write_segments(d / "colours.mp4", segs, fps=30, width=96, height=64, gop=30),
        # default x264 keyframe interval (250 frames): seeks land far back
        "sparse": write_segments(d / "sparse.mp4", segs, fps=30, width=96, height=64),
        "faststart": write_segments(d / "fast.mp4", segs[:6], fps=30, width=96, height=64, gop=30, faststart=True),
    }


@pytest.fixture(scope="session")
def red_video(tmp_path_factory):
    """40 s at 10 fps, 64x48: blue, red on [17, 20), blue (model-backed tools, collaborating agents)."""
    blue, red = (20, 40, 200), (220, 30, 30)
    return write_segments(tmp_path_factory.mktemp("red") / "red.mp4", [(blue, 17.0), (red, 3.0), (blue, 20.0)],
                          fps=10, width=64, height=48, gop=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3-VL-architecture model directory built offline."""
    from paravt_train.toy.tiny import build_tiny_model

    corpus = ["red green blue yellow purple orange window shows seconds answer question"] * 4
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus, size="test"))


@pytest.fixture(scope="session")
def toy_policy_dir():
    """The toy policy the repository ships (trained by `paravt-train toy`): it calls tools."""
    from paravt_train.toy.quickstart import REPO_CHECKPOINT

    return str(REPO_CHECKPOINT)


@pytest.fixture(scope="session")
def toy_rl(tmp_path_factory):
    """Four toy worlds (real mp4s) and their RL Parquet file."""
    from paravt_train.data import write_parquet
    from paravt_train.toy.rows import rl_rows
    from paravt_train.toy.world import make_worlds

    d = tmp_path_factory.mktemp("toyrl")
    worlds = make_worlds(range(910_000, 910_004), d / "videos")
    path = write_parquet(rl_rows(worlds, d / "videos"), d / "rl.parquet")
    return {"dir": d, "worlds": worlds, "data": str(path), "video_root": str(d / "videos")}


def worker_slice(lo: int, hi: int) -> range:
    """This pytest process's share of the ports ``lo``-``hi``: all of them alone, the k-th of n equal slices on
    xdist worker ``gwk`` of n (the workers' servers never draw the same port)."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    k = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % n
    size = (hi - lo + 1) // n
    return range(lo + k * size, lo + (k + 1) * size)


def _draw_port(ports: range, host: str, room: int, tries: int, ahead: int = 0) -> int | None:
    """A random ``port`` of ``ports`` whose ``room`` ports from it are all in ``ports``, free on ``host`` now and clear
    (they and ``port + ahead``) of every range ``paravt_train.sync.distributed.port_clash`` names (SGLang's own, the
    OS's ephemeral one as this machine sets it); None when ``tries`` draws found none."""
    import random
    import socket

    from paravt_train.sync.distributed import port_clash

    starts = ports[:len(ports) - room + 1]
    for port in random.Random().sample(starts, min(tries, len(starts))):
        if any(port_clash(p) for p in [*range(port, port + room), port + ahead]):
            continue
        try:
            for p in range(port, port + room):
                with socket.socket() as s:
                    s.bind((host, p))
            return port
        except OSError:
            continue
    return None


def free_port(host: str = "127.0.0.1", room: int = 1) -> int:
    """A free port a server started later may bind (``room`` free ones from it: a fleet takes port + 1 … port + dp),
    from this worker's slice of 10000-21999: below SGLang's NCCL ports (22000-29999, which its servers draw
    themselves) and the OS's ephemeral range (32768+ by default), where every client connection of the machine takes
    a port at any moment. A bind(0) port was taken there within the 30 s a SGLang server needs to bind it, under a
    second pytest worker's load."""
    ports = worker_slice(10000, 21999)
    port = _draw_port(ports, host, room, tries=200)
    if port is None:
        raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} outside the OS's ephemeral range")
    return port


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A free port where a weight-update group's rendezvous may listen: outside SGLang's ranges and the OS's
    ephemeral ports (``paravt_train.sync.distributed.port_clash``), from this worker's slice of 30001-31999, with
    room for the rejoin stride (a push that fails moves +100, up to +600: that port must be clear too)."""
    ports = worker_slice(30001, 31999)
    port = _draw_port(ports, host, 1, tries=400, ahead=600)
    if port is None:
        raise RuntimeError(f"no free rendezvous port in {ports.start}-{ports.stop - 1}")
    return port


class JSONServer:
    """A recording JSON server on 127.0.0.1 (the one helper for tests that script an HTTP peer): every request
    is kept as ``(method, path, body)`` in ``seen`` and answered by ``reply(path, body) -> (status, dict)``."""

    def __init__(self, reply):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                outer.seen.append((method, self.path, body))
                status, data = reply(self.path, body)
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self):  # noqa: N802
                self._answer("POST")

            def do_GET(self):  # noqa: N802
                self._answer("GET")

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    @property
    def bodies(self) -> list[dict]:
        """The bodies POSTed, in order."""
        return [b for m, _, b in self.seen if m == "POST"]

    @property
    def paths(self) -> list[str]:
        return [p for _, p, _ in self.seen]

    def close(self) -> None:
        self.srv.shutdown()


@pytest.fixture
def json_server():
    """A factory: ``json_server(reply)`` starts a :class:`JSONServer`; all stop at teardown."""
    servers = []

    def start(reply) -> JSONServer:
        s = JSONServer(reply)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


class SGLangStub:
    """The SGLang-API test server (tests/sglang_server.py) as a subprocess on 127.0.0.1.

    ``deterministic`` (on by default in tests, SGLang's ``--enable-deterministic-inference``): a request's
    ``sampling_seed`` fixes its samples, so a test that seeds its requests gets the same tokens on every run."""

    def __init__(self, model: str, deterministic: bool = True, threads: int = 1, sampling_defaults: str = "model"):
        import subprocess
        import sys
        import time
        import urllib.request
        from pathlib import Path

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, str(Path(__file__).with_name("sglang_server.py")), "--model", model,
                "--port", str(self.port)]
        if deterministic:
            args.append("--enable-deterministic-inference")
        args += ["--sampling-defaults", sampling_defaults]
        env = {**os.environ, "SGLANG_STUB_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang test server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("the SGLang test server did not start")

    def post(self, path: str, body: dict) -> dict:
        import httpx

        r = httpx.post(self.url + path, json=body, timeout=300)
        return r.json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()


@pytest.fixture
def sglang_stub():
    """A factory: ``sglang_stub(model_dir, deterministic=True)`` starts a server; all stop at teardown."""
    servers = []

    def start(model: str, **kw) -> SGLangStub:
        require_contract()
        s = SGLangStub(model, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def require_contract() -> None:
    """The stand-in SGLang server checks every request with SGLang's own contract types: without them (a machine
    that could not run `make sglang-contract`) its tests skip, saying so (fail under PARAVT_REQUIRE_ENGINES)."""
    if not (Path(__file__).resolve().parents[1] / ".sglang-contract" / "api_types.py").is_file():
        engine_unavailable("SGLang's contract types are not here (`make sglang-contract`, or send .sglang-contract/ "
                           "to a machine without a registry): the stand-in checks every request with them")


def engine_unavailable(reason: str | None) -> None:
    """Skip a test whose real engine or server is not installed here (SGLang's CPU engine, its contract, lmms-eval,
    PostgreSQL, Chromium, curl, network namespaces), saying why; with ``PARAVT_REQUIRE_ENGINES=1`` (CI's
    ``.ci/run``) fail it instead, so a failed ``make sglang-cpu`` cannot leave a green run with none of them."""
    if not reason:
        return
    if os.environ.get("PARAVT_REQUIRE_ENGINES", "").strip() not in ("", "0"):
        pytest.fail(f"{reason}; PARAVT_REQUIRE_ENGINES is set, so this is a failure, not a skip", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def host_bed(tmp_path):
    """A factory: ``host_bed(["a", "b"], no_shared_disk={"b"})`` makes network hosts on this machine
    (tests/hosts.py: namespaces, each its own address, loopback and view of the disk; the test process is
    ``bed.here``), torn down after the test however it ends. Skips, saying why, where namespaces cannot be made
    (not root); fails instead under PARAVT_REQUIRE_ENGINES (CI runs as root)."""
    from tests.hosts import HostBed, unavailable

    engine_unavailable(unavailable())
    beds = []

    def make(names: list[str], **kw) -> HostBed:
        bed = HostBed(names, root=tmp_path / f"hosts-{len(beds)}", **kw)
        beds.append(bed)
        return bed

    yield make
    for bed in beds:
        bed.close()


@pytest.fixture(scope="session")
def real_sglang(tmp_path_factory):
    """SGLang 0.5.23's own server on CPU (``.venv-sglang``, ``make sglang-cpu``), shared by the session: a factory
    ``real_sglang(model_dir)`` that starts one per model directory on first use and hands the same one back later
    (at most two live at once: starting a third stops the least recently used; the suite keeps one, the toy
    policy's, and gives other models servers of their own with ``own_sglang``). Skips, saying why, where the CPU
    engine is not installed. A test that changes a server's weights restores them (``server.reset()``; the
    ``sglang_toy`` fixture does it before every test)."""
    from tests.sglang_cpu.server import SGLangServer, unavailable

    engine_unavailable(unavailable())
    logs = tmp_path_factory.mktemp("sglang-logs")
    live: dict[str, SGLangServer] = {}

    def get(model: str, fresh: bool = False) -> SGLangServer:
        model = str(model)
        srv = live.pop(model, None)
        if srv is not None and (fresh or not srv.alive()):
            srv.close()
            srv = None
        if srv is None:
            while len(live) >= 2:
                live.pop(next(iter(live))).close()
            srv = SGLangServer(model, logs)
        live[model] = srv  # most recently used last
        return srv

    yield get
    for srv in live.values():
        srv.close()


@pytest.fixture
def own_sglang(tmp_path):
    """A factory: ``own_sglang(model_a, model_b, ...)`` starts real SGLang servers of this test's own (for a model
    directory no other test serves), side by side, and returns them; all stop at teardown. A model given as
    ``(model, {options})`` gets those server options over the shared ``**kw``. Skips like ``real_sglang``."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.sglang_cpu.server import SGLangServer, unavailable

    engine_unavailable(unavailable())
    servers: list = []

    def start(*models, **kw) -> list:
        specs = [(m, {}) if not isinstance(m, tuple) else m for m in models]
        with ThreadPoolExecutor(len(models)) as pool:
            futures = [pool.submit(SGLangServer, str(m), tmp_path / "sglang-logs", **{**kw, **own})
                       for m, own in specs]
            started, errors = [], []
            for f in futures:
                try:
                    started.append(f.result())
                except Exception as exc:  # noqa: BLE001 (raised once every server has been waited for)
                    errors.append(exc)
        servers.extend(started)
        if errors:
            raise errors[0]
        return started

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
def sglang_toy(real_sglang, toy_policy_dir):
    """The session's real SGLang server with the shipped toy policy, back on its launch weights (version
    "default", cache flushed, generation running) for this test."""
    srv = real_sglang(toy_policy_dir)
    srv.reset()
    yield srv
    assert srv.alive(), f"the SGLang server died during the test: {srv.tail()}"


def _pg_bin(name: str) -> str | None:
    import glob
    import shutil

    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return hits[-1] if hits else None


@pytest.fixture(scope="session")
def postgres_url():
    """A real PostgreSQL server for this session (Debian's ``postgresql`` package), on 127.0.0.1.

    Skips, saying why, where the binaries are missing or the server cannot start."""
    import shutil
    import subprocess
    import time

    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        engine_unavailable("PostgreSQL is not installed (apt-get install postgresql, or make test)")
    try:
        import psycopg
    except ImportError:
        engine_unavailable("psycopg is not installed (pip install 'paravt[postgres]')")
    import tempfile
    from pathlib import Path

    # not under pytest's own temp root: that is private to this user (0700), and the server runs as another
    root = Path(tempfile.mkdtemp(prefix="paravt-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    run_as: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: run it as the package's own user
        runuser = shutil.which("runuser")
        if runuser is None:
            engine_unavailable("running as root without runuser: cannot start PostgreSQL as another user")
        run_as = [runuser, "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = free_port()
    try:
        subprocess.run(run_as + [initdb, "-D", str(data), "-U", "paravt", "--auth=trust", "-E", "UTF8"],
                       check=True, capture_output=True, timeout=120)
        subprocess.run(run_as + [pg_ctl, "-D", str(data), "-l", str(root / "log.txt"), "-w", "-t", "60", "-o",
                                 f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                       check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        engine_unavailable(f"PostgreSQL could not start: {exc} {err.decode(errors='replace')[-500:]}")
    url = f"postgresql://paravt@127.0.0.1:{port}/postgres"
    deadline = time.time() + 30
    while True:
        try:
            psycopg.connect(url).close()
            break
        except psycopg.OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)
    yield url
    subprocess.run(run_as + [pg_ctl, "-D", str(data), "-m", "fast", "stop"], capture_output=True, timeout=60)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_db(postgres_url):
    """A fresh database on the session's PostgreSQL server (its URL)."""
    import uuid

    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_url.rsplit("/", 1)[0] + "/" + name
