"""vLLM serves sparsegen's checkpoints with sparsegen's own greedy tokens. Runs in vLLM's own venv (`make test-vllm`,
after `python -m tests.vllm.prepare runs/vllm` wrote the checkpoints and sparsegen's tokens); skipped elsewhere."""

import json
import os
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

EXPECTED = Path(os.environ.get("SPARSEGEN_VLLM_RUNS", "runs/vllm")) / "expected.json"
if not EXPECTED.exists():
    pytest.skip(f"{EXPECTED} is missing: run `make test-vllm`", allow_module_level=True)
CASES = json.loads(EXPECTED.read_text())
WINDOWED = CASES.pop("window")  # served with its own settings (below)


QUANTIZED_PREFIX = 4  # a quantized checkpoint runs in vLLM's mixed-precision kernel with bf16 activations, sparsegen's
# in fp32: greedy continuations agree on the first tokens of every prompt, then may drift apart (a wrongly loaded
# weight would differ at once)
TEACHER_FORCED_TOP = 20  # int8 inputs (W4A8, W8A8): vLLM's kernels round each token's activations their own way (on
# an asymmetric grid), so greedy text drifts within a few tokens; fed sparsegen's continuation, vLLM ranks each of its
# tokens first at least half the time and never below this (a wrongly loaded weight ranks them in the thousands)
MISSING_OP = "'_OpNamespace' '_C' object has no attribute"  # the CPU build picked a kernel it was built without
# (an AVX2 build and int4 W4A16: cpu_gemm_wna16)
NO_KERNEL = "Failed to find a kernel"  # vLLM's CPU build has none for this scheme (its worker logs why, per kernel)
AMX = torch.cpu._is_amx_tile_supported()  # vLLM's W8A8 kernel on an AMX CPU takes only bf16 or fp16 activations (in
# fp32 its engine dies: "int8_scaled_mm_with_quant: expect A to be bfloat16 or half")
W4A16_ONLY = ("VLLM_CPU_INT4_W4A8", "0")  # on a CPU with AMX, vLLM runs a W4A16 checkpoint as W4A8 by default: it
# rounds each token's activations to int8 (greedy text drifts within a token or two); this keeps the checkpoint's own
# scheme, bf16 activations (the default is checked on its own, below)


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_gives_sparsegens_greedy_tokens(name, capfd, monkeypatch):
    case = CASES[name]
    quantized, int8_inputs = name.startswith("int"), name.endswith("a8")
    monkeypatch.setenv(*W4A16_ONLY)  # read by vLLM's engine process, started below
    try:
        bf16 = quantized and (not int8_inputs or (AMX and name == "int8a8"))
        llm = _short_llm(case["path"], "bfloat16" if bf16 else "float32")
        if int8_inputs:
            return _check_teacher_forced(llm, name, case["rows"])
        params = vllm.SamplingParams(temperature=0.0, max_tokens=len(case["rows"][0]["tokens"]), ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": row["prompt_ids"]} for row in case["rows"]], params)
    except Exception as err:  # noqa: BLE001 (the engine's own error only says its core failed to start)
        logged = "".join(capfd.readouterr()) + str(err)
        if quantized and MISSING_OP in logged:
            op = logged.split(MISSING_OP, 1)[1].split()[0].strip("'\"")
            pytest.skip(f"vLLM accepts the {name} checkpoint and loads its weights, but its CPU build for this "
                        f"processor lacks {op}, the kernel it picked for them")
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


@pytest.mark.skipif(not AMX, reason="vLLM's W4A8 default for int4 needs AMX")
def test_vllms_default_int4_kernel_on_amx_rounds_activations_to_int8(monkeypatch):
    """On a CPU with AMX, vLLM's default (``VLLM_CPU_INT4_W4A8=1``) runs the W4A16 checkpoint through its W4A8
    kernel: the same int4 weights, each token's activations rounded to int8. So it is held to the int8-input checks:
    fed sparsegen's continuation, it ranks most of its tokens first (a wrongly read weight would not)."""
    monkeypatch.setenv(W4A16_ONLY[0], "1")
    llm = _short_llm(CASES["int4"]["path"], "bfloat16")
    _check_teacher_forced(llm, "int4 (vLLM's default W4A8 kernel)", CASES["int4"]["rows"])


def _short_llm(path: str, dtype: str):
    """vLLM on CPU for the short prompts (gpu_memory_utilization there: the share of RAM it reserves; its default
    0.92 rarely fits)."""
    return vllm.LLM(model=path, dtype=dtype, max_model_len=512, enforce_eager=True, seed=0, gpu_memory_utilization=0.3)


def _check_teacher_forced(llm, name: str, rows: list[dict]) -> None:
    """vLLM's rank of each of sparsegen's greedy tokens, given the prompt and sparsegen's tokens before it."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": row["prompt_ids"] + row["tokens"]} for row in rows], params)
    for row, output in zip(rows, outputs):
        start = len(row["prompt_ids"])
        ranks = [output.prompt_logprobs[start + i][token].rank for i, token in enumerate(row["tokens"])]
        first = sum(rank == 1 for rank in ranks)
        print(f"{name}: {row['prompt']!r}: vLLM ranks {first} of {len(ranks)} of sparsegen's tokens first, "
              f"the worst {max(ranks)}")
        assert 2 * first >= len(ranks) and max(ranks) <= TEACHER_FORCED_TOP, (row["prompt"], ranks)


def _pooled_llm(path: str, pool_tokens: int, max_model_len: int, **options):
    """vLLM on CPU with a KV pool of ``pool_tokens`` tokens of SmolLM2's full fp32 K/V (46 KB a token) and prefill
    chunks of 512 tokens."""
    return vllm.LLM(model=path, dtype="float32", max_model_len=max_model_len, enforce_eager=True, seed=0,
                    kv_cache_memory_bytes=pool_tokens * WINDOWED["kv_bytes_per_token"], max_num_batched_tokens=512,
                    enable_prefix_caching=False, **options)


def test_vllm_serves_the_windowed_checkpoint_as_sparsegens_window_policy():
    """`sparsegen export-window --window W`: vLLM's sliding window of W tokens (itself included) keeps what
    sparsegen's ``window`` policy with W - 1 held tokens keeps, on a prompt far past the window: the same greedy
    tokens."""
    llm = _pooled_llm(WINDOWED["path"], pool_tokens=8192, max_model_len=2048)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=len(WINDOWED["rows"][0]["tokens"]), ignore_eos=True)
    for row, output in zip(WINDOWED["rows"], llm.generate([{"prompt_token_ids": r["prompt_ids"]}
                                                           for r in WINDOWED["rows"]], params)):
        assert list(output.outputs[0].token_ids) == row["tokens"], row["prompt"]


def test_vllm_serves_a_32k_conversation_in_a_pool_of_4k_tokens(capfd):
    """The windowed checkpoint answers a 32K-token prompt (SmolLM2 is trained to 8K) from a KV pool of 4,096 tokens:
    vLLM frees blocks outside the window, so memory stays flat past it. The same pool refuses the model's
    unwindowed checkpoint at that length (it would need every token's K/V). The greedy tokens are compared with
    sparsegen's window policy over the same 32K prompt."""
    long, context = WINDOWED["long"], WINDOWED["long_context"]
    with pytest.raises(Exception) as refused:  # noqa: B017 (the engine's own error only says its core failed)
        _pooled_llm(CASES["dense"]["path"], pool_tokens=4096, max_model_len=context,
                      hf_overrides={"max_position_embeddings": context})  # the same positions as the windowed one
    logged = "".join(capfd.readouterr()) + str(refused.value)
    assert "larger than the available KV cache memory" in logged, logged[-2000:]
    llm = _pooled_llm(WINDOWED["path"], pool_tokens=4096, max_model_len=context)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=len(long["tokens"]), ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": long["prompt_ids"]}], params)
    got = list(output.outputs[0].token_ids)
    agree = next((i for i, (a, b) in enumerate(zip(got, long["tokens"])) if a != b), len(got))
    print(f"window {WINDOWED['window']}, {len(long['prompt_ids']):,}-token prompt: vLLM and sparsegen agree for "
          f"{agree} of {len(got)} tokens")
    assert agree >= QUANTIZED_PREFIX  # fp32 both, but 32K tokens of rounding: a wrong window differs at once
