# Both entry points bootstrap their own virtualenv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: test run bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

run: $(STAMP)
	$(VENV)/bin/npuserve serve

bench: $(STAMP)
	$(VENV)/bin/npuserve bench-ipc
	$(VENV)/bin/npuserve bench-backend --backend ref
	$(VENV)/bin/npuserve simulate
	$(VENV)/bin/npuserve bench-serve --backend stub

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
