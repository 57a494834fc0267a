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
	@echo
	$(VENV)/bin/sparsegen generate --model reference --max-new-tokens 80 --temperature 0.8 --seed 0 \
		--prompt "It was late in the evening when the old man came back to the house, and"
	@echo
	$(VENV)/bin/sparsegen compare --model reference --prompt-file examples/long_prompt.txt \
		--policies full,window,streaming,h2o --budget 128 --chunk-size 64 --max-new-tokens 40

test: setup
	$(VENV)/bin/pytest -q

# The oldest transformers this package claims (pyproject: transformers>=5.0), in its own venv.
.PHONY: test-oldest
test-oldest:
	test -x .venv-oldest/bin/python || python3 -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install -q $(TORCH)
	.venv-oldest/bin/python -m pip install -q 'transformers==5.0.0' -e '.[dev]'
	.venv-oldest/bin/pytest -q
