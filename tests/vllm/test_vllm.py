"""vLLM serves sparsegen's checkpoints with sparsegen's own greedy tokens. Runs in vLLM's own venv (`make test-vllm`,
after `python -m tests.vllm.prepare runs/vllm` wrote the checkpoints and sparsegen's tokens); skipped elsewhere."""

import json
import os
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

EXPECTED = Path(os.environ.get("SPARSEGEN_VLLM_RUNS", "runs/vllm")) / "expected.json"
if not EXPECTED.exists():
    pytest.skip(f"{EXPECTED} is missing: run `make test-vllm`", allow_module_level=True)
CASES = json.loads(EXPECTED.read_text())


QUANTIZED_PREFIX = 8  # a quantized checkpoint: vLLM's kernels and sparsegen's dequantized matmul round differently,
# so greedy tokens must agree for this many tokens, not all 32
NO_KERNEL = ("Failed to find a kernel", "cpu_gemm_wna16", "not supported by CPUWNA16")  # vLLM's CPU build lacks it


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_gives_sparsegens_greedy_tokens(name):
    case = CASES[name]
    quantized = name.startswith("int")
    try:
        llm = vllm.LLM(model=case["path"], dtype="float32" if not quantized else "bfloat16", max_model_len=512,
                       enforce_eager=True, seed=0,
                       gpu_memory_utilization=0.3)  # on CPU: the share of RAM it reserves (its default 0.92 rarely fits)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=len(case["rows"][0]["tokens"]), ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": row["prompt_ids"]} for row in case["rows"]], params)
    except Exception as err:  # noqa: BLE001 (vLLM raises plain RuntimeErrors and AttributeErrors for a missing kernel)
        if quantized and any(words in str(err) for words in NO_KERNEL):
            pytest.skip(f"vLLM accepted the {name} checkpoint's config but has no CPU kernel for it here: {err}")
        raise
    for row, output in zip(case["rows"], outputs):
        got = list(output.outputs[0].token_ids)
        if quantized:
            assert got[:QUANTIZED_PREFIX] == row["tokens"][:QUANTIZED_PREFIX], row["prompt"]
        else:
            assert got == row["tokens"], row["prompt"]
