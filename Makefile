# The two commands of the README: `make demo` and `make test`. Both set everything up themselves
# in a project-local virtual environment on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines: torch 2.13.0 installs from a local wheel where one exists (no multi-GB CUDA
# download); GPU users may set TORCH_SPEC to the build they want. The package itself declares torch>=2.3.
TORCH_SPEC ?= torch==2.13.0
PEERS ?= 3
ROUNDS ?=
PYTEST_ARGS ?=

.PHONY: install demo test test-slow test-tools bench proto clean

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "lowcomm needs Python 3.11 or newer (set PYTHON=python3.11)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	@touch $@

install: $(BIN)/.installed

# A local swarm of $(PEERS) peers through the real CLI; Ctrl-C stops it, ROUNDS=N exits once every peer did N rounds.
demo: install
	$(BIN)/python -m lowcomm.node.localswarm --peers $(PEERS) $(if $(ROUNDS),--rounds $(ROUNDS),)

# Debian packages some tests use, as package:command. Missing ones are installed where that is
# possible (root with apt-get) and left alone otherwise: those tests then skip and say why. The
# test session itself installs nothing.
TEST_DEBS ?= prometheus:promtool faketime:faketime shellcheck:shellcheck
test-tools:
	@missing=""; for pair in $(TEST_DEBS); do \
	  command -v "$${pair#*:}" >/dev/null 2>&1 || missing="$$missing $${pair%%:*}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "not installing$$missing (needs root and apt-get): the tests that use it skip"; exit 0; fi; \
	echo "installing Debian packages for the tests:$$missing"; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } || \
	  echo "could not install$$missing: the tests that use it skip"

test: install test-tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The slower suites `make test` leaves out (marker "slow", about 13–15 min): the benchmarks' smoke
# runs (bench/*.py end to end on tiny settings), the network-namespace clusters (root, ip, tc;
# they skip with the reason elsewhere) and the longest CLI swarms (buckets, cross-group, gossip,
# Hugging Face models, CPU kernels, run secret, clock skew, state-syncing methods, SparseLoCo,
# stragglers, a failed overlapped round, a busy codec pool at shutdown), whose logic also has
# socket-free tests in `make test`. CI runs it after `make test`.
test-slow: install test-tools
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# The standard benchmark set (bench/README.md): codecs, convergence, slow links and transport
# (those two need root for network namespaces), then bench/RESULTS.md and bench/plots/.
bench: install
	$(BIN)/python bench/run_all.py

# Regenerate protocol/_pb after editing proto/lowcomm/v1/*.proto.
proto: install
	$(BIN)/python protocol/gen_proto.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis

# The compose cluster of deploy/docker-compose.yml with podman, on a machine without a Docker
# engine or an image registry (deploy/README.md): Debian base from debootstrap, images built
# offline, bootstrap + $(PEERS) peers + Prometheus. Installs podman & co. from Debian (root).
PODMAN_COMPOSE_VERSION ?= 1.6.0
CLUSTER := PEERS=$(PEERS) TORCH_SPEC=$(TORCH_SPEC) PIP=$(CURDIR)/$(BIN)/pip \
	PODMAN_COMPOSE=$(CURDIR)/$(BIN)/podman-compose deploy/podman/cluster.sh

.PHONY: cluster cluster-down test-containers

$(BIN)/podman-compose: $(BIN)/.installed
	$(BIN)/pip install --quiet "podman-compose==$(PODMAN_COMPOSE_VERSION)"
	@touch $@

cluster: $(BIN)/podman-compose
	@$(CLUSTER) setup
	@$(CLUSTER) images
	@$(CLUSTER) up

# KEEP_VOLUMES=1 keeps the checkpoints (named volumes) for the next `make cluster`.
cluster-down: $(BIN)/podman-compose
	@$(CLUSTER) down

# Builds the images (cached) and runs tests/test_containers.py (minutes; not part of `make test`).
# Where podman cannot be installed (no root) the test skips and says why.
test-containers: $(BIN)/podman-compose
	@$(CLUSTER) setup || echo "test-containers: podman is not set up; tests/test_containers.py skips"
	$(BIN)/python -m pytest -m containers tests/test_containers.py $(PYTEST_ARGS)
