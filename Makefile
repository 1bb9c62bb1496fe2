# boxwarden developer targets. `make setup` is idempotent; every other target depends on it.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROTO_SRC := $(wildcard proto/boxwarden_pb/v1/*.proto)
PROTO_OUT := proto/boxwarden_pb/v1
STAMP := $(VENV)/.setup-stamp

.PHONY: setup sysdeps proto proto-check lint py39-check typecheck test crash test-gpu bench demo wheel clean

setup: $(STAMP)

# System tools the tests and benchmarks call (b3sum is the reference hasher; sshd and rsync serve
# the transport tests; tmux is the detach tool a job may hand its work to; libfuse2 serves the
# case-insensitive filesystem of tests/cifuse.py). Installed with apt when
# missing and we are root; otherwise say what to run.
sysdeps:
	@missing=""; \
	command -v b3sum >/dev/null || missing="$$missing b3sum"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	test -x /usr/sbin/sshd || missing="$$missing openssh-server"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	ldconfig -p | grep -q 'libfuse\.so\.2 ' || missing="$$missing libfuse2"; \
	/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "missing system packages:$$missing -- run: sudo apt-get install -y$$missing"; exit 1; fi; \
	fi

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=25.1"
	$(BIN)/python -m pip install -q --group dev -e ".[gpu]"
	touch $(STAMP)

proto: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iproto \
	    --python_out=proto --grpc_python_out=proto --mypy_out=proto --mypy_grpc_out=proto $(PROTO_SRC)

proto-check: proto
	@git diff --exit-code --stat -- $(PROTO_OUT) || { echo "generated code drifted from proto/: run 'make proto' and commit"; exit 1; }
	@test -z "$$(git status --porcelain --untracked-files=all -- $(PROTO_OUT))" || { echo "untracked generated files in $(PROTO_OUT): run 'make proto' and commit"; exit 1; }

lint: $(STAMP) py39-check
	$(BIN)/ruff check sidecar controller tests bench examples
	$(BIN)/ruff format --check sidecar controller tests bench examples

# The sidecar runs on the box's own Python, 3.9 and newer (the controller on 3.11+). vermin: newer
# stdlib names, keyword arguments and syntax (the .pyi stubs are never run); mypy for 3.10: newer
# methods of typed values (mypy no longer targets 3.9); tests/test_py39.py: `X | Y` unions of types
# evaluated at run time. ruff holds sidecar/ to 3.9 syntax (per-file-target-version).
py39-check: $(STAMP)
	$(BIN)/vermin -q -t=3.9- --violations --no-tips --exclude-regex '\.pyi$$' sidecar proto/boxwarden_pb
	$(BIN)/mypy --python-version 3.10 --cache-dir .mypy_cache/py310 sidecar
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_py39.py

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) sysdeps
	$(BIN)/python -m pytest -q -n 4 --dist worksteal

# The long randomized runs (.ci/run runs them after `make test`, which runs fewer of each): kill -9
# at random moments of pushes, 50 times per durable backend (file://, s3://); 100 generated trees
# through the whole lifecycle.
crash: $(STAMP) sysdeps
	BOXWARDEN_CRASH_ROUNDS=50 BOXWARDEN_TREE_EXAMPLES=100 $(BIN)/python -m pytest -q -n 2 \
	    tests/sidecar/test_crash.py tests/test_tree_invariant.py::test_every_file_is_pulled_or_named \
	    "tests/test_s3_store.py::test_kill9_while_pushing_to_a_bucket_never_leaves_a_false_durable_claim_nor_an_upload"

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu --run-gpu

bench: $(STAMP) sysdeps
	$(BIN)/python -m bench

demo: $(STAMP)
	bash examples/demo.sh

wheel: $(STAMP)
	$(BIN)/python -m build --wheel --outdir dist .

clean:
	rm -rf dist build *.egg-info .mypy_cache .ruff_cache .pytest_cache
