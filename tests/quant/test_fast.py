"""Runtime low-bit weights (``--weights int8|int4|w8a8|w4a8|w5a8``): each kernel computes what its stored weight says
(and, w8a8, w4a8 and w5a8, its input quantized as it says), the model's logits stay close to fp32's, and the bytes a
decode step reads drop to a quarter / an eighth."""

import sys

import pytest
import torch

from sparsegen.allocator import page_out, release_freed_memory
from sparsegen.bench import roofline
from sparsegen.bench.roofline import weight_bytes_per_step
from sparsegen.cli import main
from sparsegen.engine.context import CompressedContext
from sparsegen.kv import EvictionCache, KVQuantization, make_policy
from sparsegen.kv.rows import stack
from sparsegen.models.compat import cache_kwargs
from sparsegen.quant import fast, restore
from sparsegen.quant.fast import BlockEmbedding, Int4Linear, Int8Linear, TiedHead, W4A8Linear, W5A8Linear, W8A8Linear
from sparsegen.quant.restore import SharedInput, dequantized, quantize_weights
from tests.conftest import tiny_llama_config
from tests.kv.families import tiny_model
from tests.models.test_real_models import _installed

VOCAB = 320  # (the int4 kernel takes output widths divisible by 16)


def _model(**config):  # widths that are multiples of the int4 group (32)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(VOCAB, **config)).eval()


@pytest.mark.parametrize("weights", ["w8a8", "w4a8"])
def test_integer_kernel_weights_hold_kv_in_float16_unless_told(weights):
    """Where the linears run in the integer kernels on a CPU (a GGUF model's default), caches hold K/V as float16
    numbers, as llama.cpp does; ``kv_bits=32`` keeps them as computed, and a cache rebuilt from another (stacked rows,
    a saved context) keeps that one's storage, not the model's default."""
    model = _model()
    assert EvictionCache(model, make_policy("full")).quantization is None  # (fp32 weights: as computed)
    quantize_weights(model, weights)
    default, computed = (EvictionCache(model, make_policy("h2o", 10), kv_bits=bits) for bits in (None, 32))
    assert default.quantization == KVQuantization(16) == default.kv_bits
    assert computed.quantization is None and computed.kv_bits == 32
    prompt = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for cache in (default, computed):
            model(prompt, **cache_kwargs(cache))
        assert default.layers[0].keys.dtype == torch.float16 and computed.layers[0].keys.dtype == torch.float32
        stacked = stack(model, [computed])
        restored = CompressedContext.of(model, computed, prompt).cache(model, check=False)
    for cache in (stacked, restored):
        assert cache.quantization is None and cache.layers[0].keys.dtype == torch.float32


@pytest.mark.parametrize("weights,kind", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_each_kernel_computes_its_stored_weight(weights, kind):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    x = torch.randn(5, 128)
    expected = torch.nn.functional.linear(x.bfloat16().float(), dequantized(linear, weights)) + linear.bias
    torch.testing.assert_close(kind(linear)(x), expected, atol=2e-2, rtol=1e-2)  # (bfloat16 output rounding)
    error = (dequantized(linear, weights) - linear.weight).abs().max() / linear.weight.abs().max()
    assert error < (0.01 if weights == "int8" else 0.1)  # half a step of the grid


def _seven_bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` as FBGEMM's dynamic linear sees it: 7-bit unsigned codes, one scale and zero point over the call's
    values, zero exactly representable."""
    low, high = x.min().clamp(max=0), x.max().clamp(min=0)
    scale = (high - low) / 127
    zero = (-low / scale).round().clamp(0, 127)
    return (((x / scale).round() + zero).clamp(0, 127) - zero) * scale


def test_w8a8_computes_its_stored_weight_times_its_input_turned_scaled_per_token_at_7_bits():
    """Each block of 64 inputs turned by an orthonormal Hadamard matrix (a few rows by a sum, more by a matmul), each
    token divided by its largest value, the call quantized to 7 bits, times the int8 per-channel weight turned alike,
    the token's scale multiplied back."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    kernel = W8A8Linear(linear)
    rotation = kernel.rotation
    x = torch.randn(5, 128) * torch.linspace(0.1, 10, 5)[:, None]  # tokens of different sizes
    # each token's largest turned value positive: the call's range is then not [-1, 1], whose zero point is a tie
    # (63.5) that FBGEMM's float arithmetic breaks either way
    turned = (x.view(5, 2, 64) @ rotation).view(5, 128)
    sign = turned.gather(1, turned.abs().argmax(1, keepdim=True)).sign()
    x, turned = x * sign, turned * sign
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(64))
    assert bool((rotation.abs() == 1 / 8).all())
    peak = turned.abs().amax(-1, keepdim=True)
    weight = (dequantized(linear, "w8a8").view(96, 2, 64) @ rotation).view(96, 128)  # what the codes hold
    expected = torch.nn.functional.linear(_seven_bits(turned / peak), weight) * peak + linear.bias
    torch.testing.assert_close(kernel(x), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(kernel(x[None].double())[0].float(), expected, atol=1e-4, rtol=1e-5)  # (any float)
    torch.testing.assert_close(kernel(x.repeat(4, 1)), expected.repeat(4, 1), atol=1e-4, rtol=1e-5)  # (a matmul)
    exact = (linear.weight.detach().view(96, 2, 64) @ rotation).view(96, 128)
    assert (weight - exact).abs().max() / exact.abs().max() < 0.01  # half a step of the grid
    assert sum(t.numel() * t.element_size() for t in kernel.stored_tensors()) == 96 * 128 + 96 * 4  # (+ the bias)
    assert sum(t.numel() for t in roofline.weights(torch.nn.Sequential(kernel))) == 96 * 128 + 96 + 96


def test_w8a8_codes_each_token_at_its_own_scale_and_outlier_channels_spread():
    """A chunk's large token (a prefill's first) no longer coarsens the others' codes, and one outlier channel (as
    LLMs' hidden states have) costs the token's other values less than with one scale over its raw values."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=False)
    kernel, x = W8A8Linear(linear), torch.randn(6, 128)
    exact = x @ linear.weight.detach().T

    def error(out: torch.Tensor) -> float:
        return float((out - exact[-5:]).norm() / exact[-5:].norm())

    alone = error(kernel(x[1:]))
    x_big = x.clone()
    x_big[0] *= 1000
    assert error(kernel(x_big)[1:]) < 1.5 * alone
    with_outlier = x.clone()
    with_outlier[:, 7] = 60
    exact = with_outlier @ linear.weight.detach().T
    # one scale over each token's raw values, even with exact weights
    unturned = _seven_bits(with_outlier[1:] / 60) * 60 @ linear.weight.detach().T
    assert error(kernel(with_outlier)[1:]) < error(unturned) / 2


def test_w8a8s_c_plus_plus_kernel_call_is_the_python_calls_result_and_lets_go_of_freed_weights():
    """The op's C++ kernel (built here: the project's CI has a compiler, as torch.compile needs) returns what the
    Python call to FBGEMM returns, bit for bit, and a freed linear's handle names no weights any more."""
    torch.manual_seed(0)
    kernel = W8A8Linear(torch.nn.Linear(128, 96))
    assert fast._native_kernels() == "c++"
    for rows in (1, 5, 40):
        x = torch.randn(rows, 128)
        called = torch.ops.sparsegen.w8a8_linear(x, kernel.handle, 96)
        assert torch.equal(called, fast._w8a8_linear(x, kernel.handle, 96))
    handle = kernel.handle
    del kernel
    with pytest.raises(RuntimeError, match=f"no packed weights hold handle {handle}"):
        torch.ops.sparsegen.w8a8_linear(torch.randn(1, 128), handle, 96)
    assert handle not in fast._PACKED


@pytest.mark.heavy
def test_w8a8_without_a_compiler_warns_and_calls_fbgemm_from_python():
    """Where the C++ call cannot be built, the op says why and runs its Python kernel (same results, slower)."""
    import subprocess

    script = """
import warnings, torch, torch.utils.cpp_extension as cpp
def no_compiler(*args, **kwargs):
    raise RuntimeError("Ninja is required to load C++ extensions")
cpp.load = no_compiler
from sparsegen.quant import fast
torch.manual_seed(0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kernel = fast.W8A8Linear(torch.nn.Linear(128, 96))
print(fast._native_kernels(), [str(w.message) for w in caught if "C++" in str(w.message)])
x = torch.randn(3, 128)
print(tuple(kernel(x).shape))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith("python [") and "Ninja is required" in out and "Install a C++ compiler" in out, out
    assert out.split("\n")[1] == "(3, 96)", out


def _q4_1_weights(out_features: int, in_features: int) -> torch.Tensor:
    """Weights on a Q4_1 grid, as a GGUF's Q4_1 blocks dequantize: ``d * code + m`` with fp16 ``d`` and ``m`` per 32."""
    groups = (out_features, in_features // 32)
    d, m = (torch.rand(groups) * 0.02 + 1e-3).half().float(), (torch.randn(groups) * 0.1).half().float()
    codes = torch.randint(0, 16, (*groups, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # (each block spans its grid, as llama.cpp's quantizer makes it)
    return (codes * d[..., None] + m[..., None]).view(out_features, in_features)


def _q5_0_weights(out_features: int, in_features: int) -> torch.Tensor:
    """Weights on a Q5_0 grid, as a GGUF's Q5_0 blocks dequantize: ``d * (code - 16)`` with an fp16 ``d`` (either
    sign) per 32, the block's largest magnitude at code 0, as llama.cpp's quantizer puts it."""
    groups = (out_features, in_features // 32)
    d = ((torch.rand(groups) * 0.02 + 1e-3) * (torch.randint(0, 2, groups) * 2 - 1)).half().float()
    codes = torch.randint(1, 32, (*groups, 32))
    codes[..., 5] = 0
    return ((codes - 16) * d[..., None]).view(out_features, in_features)


BLOCK_KERNELS = {"w4a8": (W4A8Linear, _q4_1_weights, 4), "w5a8": (W5A8Linear, _q5_0_weights, 5)}


@pytest.mark.parametrize("weights", BLOCK_KERNELS)
def test_block_kernel_is_its_reference_and_a_gguf_weight_lands_on_its_own_grid(weights):
    """The C++ kernel (AVX2 here) computes what ``blocks_reference`` computes step for step (the integer sums exact,
    the float terms summed in another order); weights already on the Q4_1 (Q5_0) grid are stored exactly; the input's
    8 bits a block of 32 cost far less than the weights' 4 (5)."""
    kind, on_grid, bits = BLOCK_KERNELS[weights]
    op = getattr(torch.ops.sparsegen, f"{weights}_linear")
    torch.manual_seed(0)
    linear = torch.nn.Linear(608, 190)  # (19 blocks: the kernel takes two a turn; 190 outputs: 95 a thread)
    with torch.no_grad():
        linear.weight.copy_(on_grid(190, 608))
    kernel = kind(linear)
    assert fast._native_kernels() == "c++"
    assert torch.equal(kernel.dequantized(), linear.weight)  # (a GGUF's weights, back on their grid)
    # 5 bits a weight, as Q4_1; w5a8: 6 and the last plane of fifth bits rounded up (19 blocks: 3 planes of 32 bytes)
    assert kernel.blocks.shape == (190, 19 * 20 + (3 * 32 if bits == 5 else 0))
    for rows in (1, 5, 21, 40):  # (the kernel takes rows eight at a time: 21 ends on a block of 5)
        x = torch.randn(rows, 608) * torch.linspace(0.1, 10, rows)[:, None]
        x[0, 7] = 0  # (a zero block of inputs is not a division by zero)
        x[0, :32] = 0
        called = op(x, kernel.blocks, 190)
        reference = fast.blocks_reference(x, kernel.blocks, 190, bits)
        torch.testing.assert_close(called, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        exact = x @ linear.weight.T
        assert ((kernel(x) - linear.bias - exact).norm() / exact.norm()) < 0.01  # (8-bit inputs: ~0.3% here)
    fresh = torch.nn.Linear(608, 192)
    error = (kind(fresh).dequantized() - fresh.weight).abs().max() / fresh.weight.abs().max()
    # round to nearest: half a step of Q4_1's grid (1/15 of the peak); Q5_0's reaches -16 steps on the peak's side and
    # 15 on the other, where a weight as large as the peak is clamped by one step (1/16 of it), as llama.cpp's
    assert error < (0.1 if bits == 4 else 1 / 16 + 1e-3)
    constant = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        constant.weight[:, :32] = 0.25  # (a group of equal weights: its scale is no 0 to divide by)
        constant.weight[:, 32:] = 0  # (nor an all-zero one's)
    assert torch.equal(kind(constant).dequantized(), constant.weight)
    with pytest.raises(ValueError, match=f"{weights} needs input widths divisible by 32; a linear is 48 -> 16: use"):
        kind(torch.nn.Linear(48, 16))
    with torch.no_grad():
        constant.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match="beyond its range .65504.: use --weights w8a8"):
        kind(constant)


@pytest.mark.heavy
def test_a_q5_0_tensor_of_gemmas_gguf_comes_back_exactly():
    """Not only the synthetic grid above: Gemma-3-270M's own Q5_0 weights, dequantized as the loader does, are
    stored bit for bit (their codes, their scales)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from sparsegen.models.gguf import gguf_file

    tensor = next(t for t in GGUFReader(str(gguf_file("gemma3-270m"))).tensors if t.name == "blk.0.attn_k.weight")
    assert tensor.tensor_type.name == "Q5_0"
    weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).float()
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    assert torch.equal(W5A8Linear(linear).dequantized(), weight)


def _q8_0_table(rows: int, width: int) -> torch.Tensor:
    """Values on llama.cpp's Q8_0 grid, as a GGUF's table is: an fp16 scale a block of 32 times int8 codes, each
    block's largest magnitude 127 steps (with either sign)."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-126, 127, (rows, width // 32, 32), generator=generator)
    codes[..., 3] = 127 * (torch.randint(0, 2, codes.shape[:2], generator=generator) * 2 - 1)
    scales = (torch.rand(rows, width // 32, 1, generator=generator) * 1e-3 + 1e-5).half().float()
    return (codes * scales).view(rows, width)


def test_an_embedding_table_in_q8_0_blocks_is_a_q8_0_tables_own_and_looks_up_what_the_layer_did():
    table = torch.nn.Embedding(300, 96)
    with torch.no_grad():
        table.weight.copy_(_q8_0_table(300, 96))
        table.weight[7] = 0  # (an all-zero block: no scale to divide by)
    blocks = BlockEmbedding(table)
    assert torch.equal(blocks.dequantized(), table.weight)  # stored exactly: codes and scales found again
    assert blocks.codes.dtype == torch.int8 and blocks.codes.nbytes + blocks.scales.nbytes < table.weight.nbytes / 3.5
    ids = torch.tensor([[0, 7, 299], [5, 5, 1]])
    assert torch.equal(blocks(ids), table(ids))
    fresh = torch.nn.Embedding(300, 96)  # (off the grid: round to nearest, half a step of its block's scale, and the
    # scale's fp16 rounding (2^-11 of it) times up to 127 codes)
    step = fresh.weight.detach().view(300, 3, 32).abs().amax(-1, keepdim=True) / 127
    error = (BlockEmbedding(fresh).dequantized() - fresh.weight).view(300, 3, 32).abs()
    assert (error <= step * (0.5 + 127 / 2**11)).all() and (error > step * 0.45).any()
    gemma = tiny_model("gemma3").get_input_embeddings()  # (a scaled table: the lookup times embed_scale)
    assert BlockEmbedding.fits(gemma) and not BlockEmbedding.fits(torch.nn.Embedding(10, 48))  # (48: no whole blocks)
    with torch.no_grad():
        gemma.weight.copy_(_q8_0_table(*gemma.weight.shape))
    small = ids % gemma.num_embeddings
    assert torch.equal(BlockEmbedding(gemma)(small), gemma(small)) and gemma.embed_scale != 1
    with torch.no_grad():
        table.weight[0, 0] = 1e8
    with pytest.raises(ValueError, match="beyond fp16's range .65504.*use --weights fp32"):
        BlockEmbedding(table)


@pytest.mark.heavy
def test_smollm2s_q8_0_table_comes_back_exactly():
    """SmolLM2's own token embedding (Q8_0 in its GGUF, tied to the LM head), dequantized as the loader does."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from sparsegen.models.gguf import gguf_file

    tensor = next(t for t in GGUFReader(str(gguf_file("smollm2"))).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type.name == "Q8_0"
    table = torch.nn.Embedding.from_pretrained(torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).float())
    assert torch.equal(BlockEmbedding(table).dequantized(), table.weight)


def test_a_quantized_models_table_is_in_blocks_and_not_counted_as_read_each_step():
    model = _model()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(_q8_0_table(*model.get_input_embeddings().weight.shape))
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        embedded = model.get_input_embeddings()(ids)
        quantize_weights(model, "w8a8")
        table = model.get_input_embeddings()
        assert isinstance(table, BlockEmbedding) and torch.equal(table(ids), embedded)
    assert isinstance(model.lm_head, W8A8Linear)  # (its own packed copy: FBGEMM's, faster at a batch of rows)
    every = sum(t.numel() * t.element_size() for t in roofline.weights(model))
    assert weight_bytes_per_step(model) == every - table.codes.nbytes - table.scales.nbytes  # (a row a token)


def _gguf_plan(model) -> dict[str, str]:
    """A Q4 GGUF's plan for ``model``: its decoder linears at w4a8, its head and table (tied) at 8 bits."""
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    return {**dict.fromkeys(linears, "w4a8"), "lm_head": "w8a8", restore.TABLE: "w8a8"}


@pytest.mark.heavy
@pytest.mark.parametrize("shape", [(300, 96), (64, 640)])  # (3 blocks: fewer than a turn of 8; 20: two and a half)
def test_q8_0_kernel_is_its_reference_on_either_path(shape):
    """``sparsegen::q8_0_linear`` (AVX2 here, and the scalar path in a process of its own) computes what
    ``q8_0_reference`` computes: the integer sums exact, the float terms summed in another order."""
    import os
    import subprocess

    out, width = shape
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
    scales = (torch.rand(out, width // 32, generator=generator) * 1e-2).half()
    assert fast._native_kernels() == "c++"
    for rows in (1, 4, 5, 8, 9):
        x = torch.randn(rows, width, generator=generator) * torch.linspace(0.1, 10, rows)[:, None]
        x[0, :32] = 0  # (a zero block of inputs: no division by zero)
        reference = fast.q8_0_reference(x, codes, scales, out)
        called = torch.ops.sparsegen.q8_0_linear(x, codes, scales, out)
        torch.testing.assert_close(called, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        exact = x @ (codes.float().view(out, -1, 32) * scales.float()[..., None]).view(shape).T
        assert ((called - exact).norm() / exact.norm()) < 0.01  # (8-bit inputs: ~0.5% here)
    script = f"""
import torch
from sparsegen.quant import fast
kernels = fast.kernel_path()
codes = torch.randint(-127, 128, {shape}, dtype=torch.int8)
scales = (torch.rand({out}, {width // 32}) * 1e-2).half()
x = torch.randn(5, {width})
reference = fast.q8_0_reference(x, codes, scales, {out})
error = (torch.ops.sparsegen.q8_0_linear(x, codes, scales, {out}) - reference).abs().max() / reference.abs().max()
print(kernels, float(error) < 1e-5)
"""
    env = {**os.environ, "SPARSEGEN_KERNELS": "scalar"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.split() == ["scalar", "True"], result.stdout
    with pytest.raises(RuntimeError, match="codes must be int8 .out_features, in_features."):
        torch.ops.sparsegen.q8_0_linear(torch.randn(1, width), codes.T.contiguous(), scales, out)


def test_a_gguf_models_tied_head_multiplies_by_its_tables_own_blocks():
    """Under ``gguf`` a head tied to the table reads the table's Q8_0 blocks, held once (as llama.cpp holds them),
    and its logits stay close to fp32's."""
    model = _model(tie_word_embeddings=True)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(_q8_0_table(*model.get_input_embeddings().weight.shape))
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        quantize_weights(model, "gguf", _gguf_plan(model))
        logits = model(input_ids=ids).logits
        table, head = model.get_input_embeddings(), model.lm_head
        assert isinstance(head, TiedHead) and head.table is table and not list(head.buffers())
        x = torch.randn(3, 32)
        assert torch.equal(head(x), torch.ops.sparsegen.q8_0_linear(x, table.codes, table.scales, VOCAB))
        assert torch.equal(head.dequantized(), table.dequantized())  # (the GGUF's own weights: the table's)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8  # (4-bit decoder linears)
    every = {t.data_ptr(): t.numel() * t.element_size() for t in roofline.weights(model)}
    assert weight_bytes_per_step(model) == sum(every.values())  # (the table read whole, once)


@pytest.mark.heavy
@pytest.mark.parametrize("weights", BLOCK_KERNELS)
def test_block_kernels_scalar_path_is_the_reference_too(weights):
    """The path a CPU without AVX2 takes (forced here by ``SPARSEGEN_KERNELS=scalar``), in a process of its own."""
    import os
    import subprocess

    kind, _, bits = BLOCK_KERNELS[weights]
    script = f"""
import torch
from sparsegen.quant import fast
torch.manual_seed(0)
kernel = fast.{kind.__name__}(torch.nn.Linear(608, 64))
for rows in (1, 6):
    x = torch.randn(rows, 608)
    reference = fast.blocks_reference(x, kernel.blocks, 64, {bits})
    error = (torch.ops.sparsegen.{weights}_linear(x, kernel.blocks, 64) - reference).abs().max() / reference.abs().max()
    print(fast.kernel_path(), float(error) < 1e-5)
"""
    env = {**os.environ, "SPARSEGEN_KERNELS": "scalar"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["scalar", "True"] * 2, out


_DOT_PRODUCTS = """
import sys
import torch
from sparsegen.quant import fast
torch.manual_seed(0)
outputs = {"path": fast.kernel_path()}
codes, scales = torch.randint(-127, 128, (94, 608), dtype=torch.int8), (torch.rand(94, 19) * 1e-2).half()
for rows in (1, 4, 5, 9, 21):  # (VNNI takes eight rows a call where AVX2 takes four)
    x = torch.randn(rows, 608) * 3
    for kind in (fast.W4A8Linear, fast.W5A8Linear):
        kernel = kind(torch.nn.Linear(608, 94))
        outputs[kind.__name__, rows] = kernel(x)
    outputs["q8_0", rows] = torch.ops.sparsegen.q8_0_linear(x, codes, scales, 94)
torch.save(outputs, sys.argv[1])
"""


@pytest.mark.skipif(fast.kernel_path() != "avx512-vnni", reason="this CPU has no AVX-512 VNNI")
def test_the_vnni_dot_products_give_the_avx2_outputs_to_the_bit(tmp_path):
    """On a CPU with AVX-512 VNNI the w4a8, w5a8 and Q8_0 kernels take vpdpbusd, where AVX2 takes two instructions for
    each: the same integer sums and the same float operations, so the same outputs, bit for bit (each path in a process
    of its own: ``SPARSEGEN_KERNELS`` is read once a process). A bad cap is refused by name."""
    import os
    import subprocess

    for path, cap in (("vnni", None), ("avx2", "avx2")):
        env = {k: v for k, v in os.environ.items() if k != "SPARSEGEN_KERNELS"}
        env.update({"SPARSEGEN_KERNELS": cap} if cap else {})
        subprocess.run([sys.executable, "-c", _DOT_PRODUCTS, str(tmp_path / path)], check=True, env=env)
    vnni, avx2 = torch.load(tmp_path / "vnni"), torch.load(tmp_path / "avx2")
    assert (vnni.pop("path"), avx2.pop("path")) == ("avx512-vnni", "avx2")
    assert vnni.keys() == avx2.keys() and all(torch.equal(vnni[key], avx2[key]) for key in vnni)
    bad = subprocess.run([sys.executable, "-c", "from sparsegen.quant import fast; fast.kernel_path()"],
                         capture_output=True, text=True, env={**os.environ, "SPARSEGEN_KERNELS": "avx3"})
    assert bad.returncode != 0 and "SPARSEGEN_KERNELS=avx3: give scalar or avx2" in bad.stderr


@pytest.mark.parametrize("weights", ["int8", "int4", "w8a8", "w4a8", "w5a8"])
def test_a_quantized_model_predicts_what_fp32_does_and_reads_fewer_bytes(weights):
    model = _model()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        before = weight_bytes_per_step(model)
        quantize_weights(model, weights)
        logits = model(input_ids=ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears  # every decoder linear and the LM head were replaced
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > (0.7 if weights in ("int4", "w4a8") else 0.9)
    # (w5a8 reads 6.2 bits a weight on real widths, but a row of this 32-wide model is one block beside a whole
    # 32-byte plane of fifth bits: its bytes are checked per row in the block kernels' test)
    assert weight_bytes_per_step(model) < before / (4 if weights in ("int4", "w4a8") else 2.5)


KERNEL_OPS = {"int8": (torch.ops.aten, "_weight_int8pack_mm"), "int4": (torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
              "w8a8": (torch.ops.sparsegen, "w8a8_linear"), "w4a8": (torch.ops.sparsegen, "w4a8_linear"),
              "w5a8": (torch.ops.sparsegen, "w5a8_linear")}


@pytest.mark.parametrize("weights", ["int8", "int4", "w8a8", "w4a8", "w5a8"])
def test_linears_that_read_one_input_are_one_matmul_with_each_ones_own_output(weights, monkeypatch):
    """q/k/v and gate/up run as one kernel call each: the logits are exactly those of each linear packed alone."""
    model = _model()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as patch:
        patch.setattr(restore, "_input_sharers", lambda kinds: [])
        alone = quantize_weights(_model(), weights)
    quantize_weights(model, weights)
    namespace, op = KERNEL_OPS[weights]
    kernel, calls = getattr(namespace, op), []
    monkeypatch.setattr(namespace, op, lambda *a: calls.append(1) or kernel(*a))
    with torch.inference_mode():
        expected = alone(input_ids=ids).logits
        calls.clear()
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    layers = model.config.num_hidden_layers
    # qkv, o, gate-up, down (+ the LM head, at 8 bits by another op under int4, w4a8 and w5a8)
    assert len(calls) == 4 * layers + (weights not in ("int4", "w4a8", "w5a8"))
    shared = [m for m in model.modules() if isinstance(m, SharedInput)]
    assert len(shared) == 2 * layers and all(m.pending is None for m in shared)  # nothing held between calls

    # a part called alone, or after a sibling took another input, gives its own linear's output
    attention, reference = model.model.layers[0].self_attn, alone.model.layers[0].self_attn
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(attention.k_proj(y), reference.k_proj(y), rtol=0, atol=0)
        attention.q_proj(x)
        torch.testing.assert_close(attention.v_proj(y), reference.v_proj(y), rtol=0, atol=0)
        torch.testing.assert_close(attention.k_proj(x), reference.k_proj(x), rtol=0, atol=0)
    assert attention.k_proj.out_features == reference.k_proj.out_features  # (head counts are read from it)


def test_only_linears_stored_alike_share_a_matmul():
    """A GGUF mixes bit widths within a block (Q4_K_M: v at Q6_K): only the alike are stacked."""
    kinds = {"b.self_attn.q_proj": "int4", "b.self_attn.k_proj": "int4", "b.self_attn.v_proj": "int8",
             "b.self_attn.o_proj": "int4", "b.mlp.gate_proj": "int8", "b.mlp.up_proj": "int4", "lm_head": "int8"}
    assert restore._input_sharers(kinds) == [["b.self_attn.q_proj", "b.self_attn.k_proj"]]


@pytest.mark.heavy
@pytest.mark.parametrize("weights", ["int4", "w8a8", "w4a8", "w5a8", "gguf"])
def test_a_decode_step_over_shared_matmuls_is_one_graph(weights):
    from sparsegen.engine.prefill import prefill
    from sparsegen.engine.step import DecodeStep
    from sparsegen.kv import EvictionCache, make_policy

    torch._dynamo.reset()
    model = _model(tie_word_embeddings=weights == "gguf")
    quantize_weights(model, weights, _gguf_plan(model) if weights == "gguf" else None)
    caches = [EvictionCache(model, make_policy("h2o", 10), chunk_size=8) for _ in range(2)]
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        token = [prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1) for cache in caches][0]
        step, position = DecodeStep(model, compile=True), torch.full((2,), 12)
        if weights != "int4":  # the ops' C++ kernels called from inductor's code: the eager step's logits
            torch.testing.assert_close(step(caches[0], token, position), step.uncompiled(caches[1], token, position),
                                       atol=1e-4, rtol=1e-4)
            assert step.compiled_steps == 1
        assert step.graph_breaks(caches[0], token, position + 1) == 0


def test_a_quantized_model_lets_go_of_the_file_it_was_mapped_from(tmp_path):
    """What stays at full precision (embeddings, norms) is copied out of the memory-mapped checkpoint: one tensor
    viewing the file would keep the pages packing read resident (SmolLM2 int4: 1,006 vs 601 MiB)."""
    from transformers import LlamaForCausalLM

    _model().save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    before = {name: t.data_ptr() for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    quantize_weights(model, "int8")
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    kept = [name for name in before if name in after]
    assert "model.norm.weight" in kept and "model.embed_tokens.codes" in after  # (the table: packed in memory)
    assert all(after[name].data_ptr() != before[name] for name in kept)


def _file_resident() -> int:
    from pathlib import Path

    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("RssFile:")) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_paging_out_lets_go_of_a_mapped_files_pages_and_keeps_the_data(tmp_path):
    size = 32 << 20
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (size // 256))
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    total = int(mapped.sum(dtype=torch.int64))  # every page read: resident
    before = _file_resident()
    assert page_out(mapped)
    assert before - _file_resident() > size // 2
    assert int(mapped.sum(dtype=torch.int64)) == total  # read again from the file


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_freed_heap_memory_goes_back_to_the_kernel_after_packing(monkeypatch):
    """glibc keeps freed heap blocks resident for reuse; ``release_freed_memory`` hands them back, and packing calls
    it (Gemma-3-270M's generate: 1,345 -> 968 MiB)."""
    import ctypes
    import ctypes.util
    from pathlib import Path

    def anonymous() -> int:
        return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("RssAnon:")) * 1024

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_void_p,)
    blocks = [libc.malloc(64 << 10) for _ in range(1024)]  # (under glibc's mmap threshold: on the heap)
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in blocks[:-1]:  # (the last one pins the heap's top: no plain shrink)
        libc.free(block)
    before = anonymous()
    assert release_freed_memory()
    assert before - anonymous() > 32 << 20
    libc.free(blocks[-1])
    calls = []
    monkeypatch.setattr(restore, "release_freed_memory", lambda: calls.append(1))
    quantize_weights(_model(), "w8a8")
    assert calls == [1]


def test_bad_weights_are_refused(capsys):
    with pytest.raises(ValueError, match="fp32, int8, int4"):
        quantize_weights(_model(), "int3")
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_weights(tiny_model("llama"), "int4")  # an MLP 48 wide
    assert main(["generate", "--model", "reference", "--prompt", "Hi", "--weights", "int2"]) == 2
    assert "fp32, int8, int4" in capsys.readouterr().err


@pytest.mark.heavy
def test_generate_and_bench_take_weights(capsys, tmp_path):
    assert main(["generate", "--model", "reference", "--prompt", "Once upon a time", "--max-new-tokens", "4",
                 "--weights", "int8"]) == 0
    assert main(["bench", "--model", "reference", "--policies", "full", "--contexts", "32", "--new-tokens", "2",
                 "--warmup", "1", "--weights", "fp32,int8,int4,w8a8", "--no-compile",
                 "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "speed-up of reference [int8] over reference [fp32]" in out and "reference [int4]" in out
    assert "reference [w8a8]" in out


@pytest.mark.heavy
@pytest.mark.skipif(not all(_installed(m) for m in ("smollm2", "gemma3-270m")), reason="the GGUF packages are absent")
def test_gguf_weights_follow_each_tensors_stored_type():
    from sparsegen.models.gguf import gguf_file
    from sparsegen.quant.restore import gguf_plan

    smollm2 = gguf_plan(gguf_file("smollm2"))  # Q4_1 blocks, a Q8_0 embedding tied to the head
    assert len(smollm2) == 30 * 7 + 2 and restore.TABLE in smollm2
    assert smollm2["lm_head"] == "w8a8"  # (llama.cpp's integer arithmetic, on x86)
    assert {smollm2[f"model.layers.{i}.mlp.down_proj"] for i in range(30)} == {"w4a8"}
    gemma = gguf_plan(gguf_file("gemma3-270m"))  # Q4_K_M: Q4_K beside Q5_0, Q6_K and Q8_0
    assert sorted(set(gemma.values())) == ["w4a8", "w5a8", "w8a8"] and len(gemma) == 18 * 7 + 2
    assert gemma["model.layers.0.mlp.gate_proj"] == "w5a8" and gemma["model.layers.0.self_attn.o_proj"] == "w4a8"


def test_gguf_weights_need_a_gguf_model(capsys):
    assert main(["generate", "--model", "reference", "--prompt", "Hi", "--weights", "gguf"]) == 2
    assert "not a GGUF model" in capsys.readouterr().err


def test_prefill_runs_the_prompt_through_the_integer_kernels_a_decode_step_runs(monkeypatch):
    """A packed model's prompt chunks multiply by its integer kernels, 8-bit inputs and all, as its decode steps do
    (and as llama.cpp does): a chunk's rows reach the kernel whole, and no weight is dequantized (prompts ran on the
    dequantized weights in fp32 before the kernels took input rows in blocks)."""
    from sparsegen.engine.prefill import prefill
    from sparsegen.kv import EvictionCache, make_policy

    model = quantize_weights(_model(), "w4a8")
    rows, kernel = [], torch.ops.sparsegen.w4a8_linear
    monkeypatch.setattr(torch.ops.sparsegen, "w4a8_linear", lambda x, *rest: rows.append(x.shape[:-1].numel())
                        or kernel(x, *rest))
    monkeypatch.setattr(W4A8Linear, "dequantized", lambda self: pytest.fail("a prompt dequantized its weights"))
    ids = torch.randint(3, VOCAB, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill(model, EvictionCache(model, make_policy("full")), ids, torch.ones_like(ids), chunk_size=48)
    assert rows and set(rows) == {48}
