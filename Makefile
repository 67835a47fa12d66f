# Two commands on a fresh machine: `make run` and `make test` (see README.md).
PYTHON ?= python3
# our own modules compile once, not in every test's service process
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
BIN := $(VENV)/bin
SERVICE_STAMP := $(VENV)/.installed-service
DEV_STAMP := $(VENV)/.installed-dev
DS_OPS_STAMP := $(VENV)/.built-deepspeed-ops
LOCALSTACK_VENV := .venv-localstack
LOCALSTACK_STAMP := $(LOCALSTACK_VENV)/.installed

.PHONY: run test test-fast lint dist demo bench bench-save bench-tiny bench-gpu chaos screenshot proto clean fuzz soak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the service and the torch-free client: enough to run the service
$(SERVICE_STAMP): $(BIN)/python client/pyproject.toml service/pyproject.toml
	$(BIN)/pip install -q -e client -e service
	touch $@

# plus torch (the CPU wheel pinned in requirements-dev.txt) and the test tools
$(DEV_STAMP): $(SERVICE_STAMP) requirements-dev.txt
	$(BIN)/pip install -q -r requirements-dev.txt -e 'client[torch,data]'
	touch $@

# DeepSpeed's CPU ops, compiled once here rather than inside a test's ranks (tests/deepspeed_ops.py)
$(DS_OPS_STAMP): $(DEV_STAMP) tests/deepspeed_ops.py
	$(BIN)/python -m tests.deepspeed_ops
	touch $@

# LocalStack's S3, which verifies part checksums, for the direct-upload tests (tests/localstack.py):
# a virtual environment of its own, since its pins clash with the project's
$(LOCALSTACK_STAMP): requirements-localstack.txt
	test -x $(LOCALSTACK_VENV)/bin/python || $(PYTHON) -m venv $(LOCALSTACK_VENV)
	$(LOCALSTACK_VENV)/bin/pip install -q --upgrade pip
	$(LOCALSTACK_VENV)/bin/pip install -q -r requirements-localstack.txt
	touch $@

run: $(SERVICE_STAMP)
	$(BIN)/lastgood-service

# every test, in three passes: the fast subset on two workers (as test-fast); the browser, the
# bench smoke and the slow tests on two workers (each worker starts its own PostgreSQL and
# LocalStack, on free ports); then the torchrun tests on two workers as well, a test file to a
# worker (--dist loadfile: a file's services start once): most of a torchrun test waits on
# rendezvous, services and timeouts, and one at a time took twice as long. The slowest 30 of
# each pass close it: where the suite's time goes
FAST := not multiproc and not ui and not slow and not bench
test: $(DS_OPS_STAMP) $(LOCALSTACK_STAMP)
	$(BIN)/python -m pytest -n 2 -m "$(FAST)"
	$(BIN)/python -m pytest -n 2 -m "not ($(FAST)) and not multiproc" --durations=30
	$(BIN)/python -m pytest -n 2 --dist loadfile -m multiproc --durations=30

# the inner loop: everything but torchrun, the browser, the bench smoke and single slow tests
# (markers in pytest.ini), on two workers (pytest-xdist): they wait on service processes more
# than they compute; the import contracts are among them (tests/unit/test_architecture.py)
test-fast: $(DEV_STAMP)
	$(BIN)/python -m pytest -n 2 -m "$(FAST)"

# the architecture's import contracts alone (.importlinter), in a second
lint: $(DEV_STAMP)
	$(BIN)/lint-imports

# the client's and the service's wheel and sdist into dist/ (PyPA build, isolated)
dist: $(DEV_STAMP)
	$(BIN)/python -m build --outdir dist client
	$(BIN)/python -m build --outdir dist service

demo: $(DEV_STAMP)
	$(BIN)/python examples/gpt/demo.py

# the REST fuzz at full size: 10,000 generated cases per auth mode (tokens off, tokens on),
# a fresh seed each time, with schemathesis's conformance checks on every answer (docs/security.md,
# "REST conformance"); `make test` runs the same test with 300 cases and a fixed seed
FUZZ_CASES ?= 10000
fuzz: $(DEV_STAMP)
	LASTGOOD_FUZZ_CASES=$(FUZZ_CASES) LASTGOOD_FUZZ_SEED=$${LASTGOOD_FUZZ_SEED:-$$(date +%s)} \
		$(BIN)/python -m pytest -m fuzz -q -s -o timeout=3600 tests/fuzz

# the full benchmark against the peers and the limits, the disk's own variance first
# (bench/README.md says what it runs); run it on an idle machine
bench: $(DEV_STAMP)
	$(BIN)/python -m bench.run --quiet-check --quiet-wait 900

# the save-speed acceptance run (docs/performance.md): the disk's own variance first, then
# lastgood vs DCP save, restore and stall at 1 GiB and 4 GiB, 7 interleaved reps; run it on an idle machine
bench-save: $(DEV_STAMP)
	$(BIN)/python -m bench.run --quiet-check --quiet-wait 900 --only-sizes --sizes 1G,4G --reps 7

# the fixed cost of a save: a tiny state through the Checkpointer, lastgood's DCP writer and stock DCP,
# interleaved 30 times, and the fsyncs alone (bench/tiny_save.py)
bench-tiny: $(DEV_STAMP)
	$(BIN)/python -m bench.tiny_save --reps 30

# the GPU path on one CUDA device (bench/gpu.py): save()'s stall against a plain pinned copy, D2H
# against the PCIe limit, step time with saves against without, restore; under 8 minutes.
# Without CUDA it runs its CPU fallback (as tests/bench/test_gpu_smoke.py does)
bench-gpu: $(DEV_STAMP)
	$(BIN)/python -m bench.gpu

# not CI: 30 minutes of writers, scheduled GC and page polling; drift per 5-minute window (bench/README.md)
soak: $(DEV_STAMP)
	$(BIN)/python -m bench.soak --minutes 30 --windows 6

# the chaos suite, long: hundreds of service SIGKILLs with the invariants checked after each (docs/storage.md)
chaos: $(DEV_STAMP)
	LASTGOOD_CHAOS_CYCLES=$${LASTGOOD_CHAOS_CYCLES:-200} $(BIN)/python -m pytest -q -s tests/chaos -k keep --timeout=7200

# docs/lineage.png, the README's picture, from a seeded service in Chromium
screenshot: $(DEV_STAMP)
	$(BIN)/python docs/lineage.py

proto: $(DEV_STAMP)
	$(BIN)/python -m grpc_tools.protoc -I client/proto --python_out=client --pyi_out=client \
		--grpc_python_out=client client/proto/lastgood/wire/v1/lastgood.proto

clean:
	rm -rf $(VENV) $(LOCALSTACK_VENV) data demo-data
