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


QUANTIZED_PREFIX = 4  # a quantized checkpoint runs in vLLM's mixed-precision kernel with bf16 activations, sparsegen's
# in fp32: greedy continuations agree on the first tokens of every prompt, then may drift apart (a wrongly loaded
# weight would differ at once)
NO_KERNEL = "Failed to find a kernel"  # vLLM's CPU build has none for this scheme (its worker logs why, per kernel)


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_gives_sparsegens_greedy_tokens(name, capfd):
    case = CASES[name]
    quantized = name.startswith("int")
    try:
        llm = vllm.LLM(model=case["path"], dtype="float32" if not quantized else "bfloat16", max_model_len=512,
                       enforce_eager=True, seed=0,
                       gpu_memory_utilization=0.3)  # on CPU: the share of RAM it reserves (its default 0.92 rarely fits)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=len(case["rows"][0]["tokens"]), ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": row["prompt_ids"]} for row in case["rows"]], params)
    except Exception as err:  # noqa: BLE001 (the engine's own error only says its core failed to start)
        logged = "".join(capfd.readouterr()) + str(err)
        if quantized and NO_KERNEL in logged:
            reasons = [line.split("] ", 1)[-1].strip() for line in logged.splitlines()
                       if "cannot implement due to" in line or NO_KERNEL in line]
            pytest.skip(f"vLLM accepts the {name} checkpoint's config but its CPU build has no kernel for it: "
                        + " / ".join(dict.fromkeys(reasons)))
        raise
    for row, output in zip(case["rows"], outputs):
        got = list(output.outputs[0].token_ids)
        if quantized:
            agree = next((i for i, (a, b) in enumerate(zip(got, row["tokens"])) if a != b), len(got))
            assert agree >= QUANTIZED_PREFIX, (row["prompt"], f"agree for {agree} tokens")
            print(f"{name}: {row['prompt']!r}: vLLM and sparsegen agree for {agree} of {len(got)} tokens")
        else:
            assert got == row["tokens"], row["prompt"]
