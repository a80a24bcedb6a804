# Two commands a fresh clone needs (README): `make demo` and `make test`.
# Both create .venv and install what they need on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARCH := $(shell uname -m)
ifeq ($(ARCH),aarch64)
TORCH := torch==2.9.1 torchvision==0.24.1
else
TORCH := torch==2.14.1 torchvision==0.29.1
endif
# what `make install` says before the long download (sizes of the x86_64 wheels on PyPI: torch 555 MB, its NVIDIA
# CUDA libraries 2.2 GB; 4.4 GB installed)
TORCH_SIZE ?= about 2.7 GB to download (torch 555 MB and its CUDA libraries 2.2 GB; 4.4 GB installed; a CPU-only \
  build is much smaller: docs/install.md)

.PHONY: install test test-gpu lint demo bench clean browser postgres hosts sglang-contract sglang-cpu lmms-eval

# The SGLang release whose HTTP contract the test server checks every request and reply against (named here only;
# the `sglang` extra in pyproject.toml admits the range the client was tested with).
SGLANG_VERSION := 0.5.23
CONTRACT := .sglang-contract

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "[install 1/4] the virtual environment in $(VENV)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "[install 2/4] pip itself"
	@$(BIN)/python -m pip install -q --upgrade pip
	@# torch first, pinned, so no other torch build is pulled in by the ranges in pyproject.toml
	@echo "[install 3/4] $(TORCH): the large one, $(TORCH_SIZE); minutes on a fast link, pip's bar below"
	@$(BIN)/python -m pip install --progress-bar on $(TORCH)
	@echo "[install 4/4] this package with its dev and demo extras (transformers, LangGraph, PyAV, Gradio, ...)"
	@$(BIN)/python -m pip install -q -e '.[dev,demo]' --config-settings editable_mode=compat
	@touch $@
	@echo "[install] done: $(VENV) (\`source $(VENV)/bin/activate\`, or prefix commands with $(BIN)/)"

lint: install
	$(BIN)/python -m ruff check .

# the Gradio demo's test drives Debian's chromium headless (no browser download)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || \
	  echo "warning: could not install chromium; the browser test will be skipped"

# the multi-host tests make network namespaces (iproute2's `ip netns`, util-linux's `unshare`; root: CI runs as root)
hosts:
	@command -v ip >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux) || \
	  echo "warning: could not install iproute2; the multi-host tests will be skipped"

# the PostgreSQL trajectory store's tests start a real server (Debian's postgresql package)
postgres:
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) || \
	  echo "warning: could not install postgresql; the PostgreSQL store tests will be skipped"

# SGLang's HTTP JSON contract (sglang/api/v1/api_types.py, msgspec types) from the pinned wheel, no GPU stack:
# the wheel is downloaded (~40 MB, no dependencies) and only that file is kept.
sglang-contract: $(CONTRACT)/VERSION

$(CONTRACT)/VERSION: Makefile
	rm -rf $(CONTRACT) && mkdir -p $(CONTRACT)/wheel
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.11 \
	  --platform manylinux_2_34_x86_64 -d $(CONTRACT)/wheel sglang==$(SGLANG_VERSION)
	$(BIN)/python -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]); \
	  open(sys.argv[1] + '/api_types.py', 'wb').write(z.read('sglang/api/v1/api_types.py'))" $(CONTRACT)
	rm -rf $(CONTRACT)/wheel
	echo $(SGLANG_VERSION) > $@

# lmms-eval for the plugin's test (`lmms-eval --model paravt`), in .venv-lmms layered over .venv: lmms-eval 0.7.3
# pins av<16 and wandb==0.25, which would change the suite's own decoder. .venv-lmms sees .venv's packages
# (torch, transformers, paravt) through a .pth file and holds only what lmms-eval adds (~900 MB, ~2 min;
# pip leaves .venv's own copies of the packages it replaces in place).
LMMS := .venv-lmms
LMMS_EVAL_VERSION := 0.7.3

lmms-eval: $(LMMS)/.installed

$(LMMS)/.installed: $(VENV)/.installed Makefile
	rm -rf $(LMMS) && $(BIN)/python -m venv $(LMMS)
	( $(BIN)/python -c "import site; print(site.getsitepackages()[0])"; echo $(CURDIR) ) > \
	  "$$($(LMMS)/bin/python -c 'import site; print(site.getsitepackages()[0])')/paravt_base.pth"
	# filelock 4 (.venv's) dropped filelock._api, which lmms-eval 0.7.3's evaluator imports
	$(LMMS)/bin/python -m pip install -q lmms-eval==$(LMMS_EVAL_VERSION) "filelock<4" && touch $@ || \
	  echo "warning: could not install lmms-eval; the lmms-eval plugin test skips, saying why (it fails under PARAVT_REQUIRE_ENGINES=1, as in CI)"

# SGLang's own server on CPU for the sglang-path tests, in .venv-sglang layered over .venv (torch reused through a
# .pth file: ~1.3 GB, ~1.5 min, no compiling): the pinned wheel's dependencies minus the GPU-only ones, and the
# project's own CPU stand-in for SGLang's compiled kernels (tests/sglang_cpu/sgl_kernel, pinned to this release).
SGLANG_CPU := .venv-sglang

sglang-cpu: $(SGLANG_CPU)/.installed

$(SGLANG_CPU)/.installed: $(VENV)/.installed Makefile tests/sglang_cpu/install.sh tests/sglang_cpu/constraints.txt
	BASE=$(VENV) TARGET=$(SGLANG_CPU) SGLANG_VERSION=$(SGLANG_VERSION) bash tests/sglang_cpu/install.sh && touch $@ || \
	  echo "warning: could not install SGLang's CPU engine; the tests against the real SGLang server will be skipped"

PYTEST_WORKERS ?= 2

test: install browser postgres hosts sglang-contract sglang-cpu lmms-eval
	$(BIN)/python -m ruff check .
	# two workers, each test file on one (docs/install.md, "The suite"): 18 min instead of 33 on 2 cores, since much
	# of the suite waits on servers and subprocesses; PYTEST_WORKERS=0 runs it on one
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile
	# the numerics a GPU gets (bf16 weights in the local backend, bf16 autocast in the trainers), on the CPU
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m dtype --dtype bfloat16 -p no:cacheprovider

# The GPU runner: the tests of the paths that pick CUDA, on a machine with a CUDA GPU and torch (no registry needed:
# tests/gpu/bundle.py prepares the wheels where pip works; docs/gpu.md, "The GPU runner"). It writes gpu-report.md
# whatever stops it, within --timeout (540 s by default). Without .venv (a bare GPU machine) it runs with python3.
GPU_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
test-gpu:
	$(GPU_PY) tests/gpu/run.py $(GPU_ARGS)

# README command #1: the real agent on held-out toy videos, with the shipped toy policy (checkpoints/toy)
demo: install
	$(BIN)/paravt-train quickstart

bench: install
	$(BIN)/python perf/bench_video.py
	$(BIN)/python perf/bench_fanout.py
	$(BIN)/python perf/bench_local_batching.py
	$(BIN)/python perf/bench_sft.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(CONTRACT) $(SGLANG_CPU) $(LMMS)
