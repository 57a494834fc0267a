# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv once, then are fast.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sparsegen-installed
TORCH  := torch==2.13.0

.PHONY: setup demo test
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/sparsegen info reference
	$(VENV)/bin/sparsegen generate --model reference --max-new-tokens 120 --temperature 0.8 --seed 0 \
		--prompt "It was late in the evening when the old man came back to the house, and"
	@echo

test: setup
	$(VENV)/bin/pytest -q
