import pytest
import torch
from torch import nn

from sparsegen.contextual.layers import ColumnSparseLinear, RowSparseLinear


class Fixed:
    """A selection given by a mask; with ``union=True`` it also reports the sorted union (as Deja Vu does)."""

    def __init__(self, mask, union: bool = False):
        self._mask, self._union = mask, union

    def mask(self, x):
        return self._mask

    def union(self):
        return self._mask.reshape(-1, self._mask.shape[-1]).any(0).nonzero().squeeze(-1) if self._union else None


def _linear(inputs: int, outputs: int, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(inputs, outputs, bias=bias)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("unit_size", [1, 4])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("union", [False, True])
def test_column_sparse_decode_equals_the_dense_layer_on_masked_inputs(batch, unit_size, threads, union):
    torch.set_num_threads(threads)
    linear = _linear(32, 24, bias=True)
    mask = torch.rand(batch, 1, 32 // unit_size, generator=torch.Generator().manual_seed(1)) < 0.4
    x = torch.randn(batch, 1, 32)
    dense = linear(x * mask.repeat_interleave(unit_size, -1))
    decoding = True
    sparse = ColumnSparseLinear(linear, Fixed(mask, union), lambda: decoding, unit_size)
    torch.testing.assert_close(sparse(x), dense, rtol=1e-5, atol=1e-6)
    decoding = False  # the masked dense path gives the same numbers
    torch.testing.assert_close(sparse(x), dense, rtol=1e-5, atol=1e-6)


def test_column_sparse_with_nothing_chosen_gives_the_bias():
    linear = _linear(8, 4, bias=True)
    sparse = ColumnSparseLinear(linear, Fixed(torch.zeros(1, 1, 8, dtype=torch.bool)), lambda: True)
    torch.testing.assert_close(sparse(torch.randn(1, 1, 8)), linear.bias.detach().view(1, 1, 4))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("union", [False, True])
def test_row_sparse_decode_computes_the_union_of_chosen_rows(batch, copies, union):
    units = 12
    linear = _linear(16, units * copies, bias=True)
    mask = torch.rand(batch, 1, units, generator=torch.Generator().manual_seed(2)) < 0.3
    x = torch.randn(batch, 1, 16)
    sparse = RowSparseLinear(linear, Fixed(mask, union), lambda: True, copies=copies)
    union = mask.reshape(batch, units).any(0).repeat(copies)
    expected = linear(x) * union
    torch.testing.assert_close(sparse(x), expected, rtol=1e-5, atol=1e-6)
    # multi-token calls keep each token's own units
    per_token = RowSparseLinear(linear, Fixed(mask), lambda: False, copies=copies)
    torch.testing.assert_close(per_token(x), linear(x) * mask.repeat(1, 1, copies), rtol=1e-5, atol=1e-6)


def test_heads_as_units_with_a_known_union():
    linear = _linear(16, 16, bias=False)  # 4 heads of 4
    mask = torch.tensor([[[True, False, False, True]]])
    x = torch.randn(1, 1, 16)
    keep = mask.repeat_interleave(4, -1)
    rows = RowSparseLinear(linear, Fixed(mask, True), lambda: True, unit_size=4)
    torch.testing.assert_close(rows(x), linear(x) * keep)
    columns = ColumnSparseLinear(linear, Fixed(mask, True), lambda: True, unit_size=4)
    torch.testing.assert_close(columns(x), linear(x * keep), rtol=1e-5, atol=1e-6)


def test_back_to_linear_is_bit_identical():
    linear = _linear(8, 6, bias=True)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    for sparse in (ColumnSparseLinear(linear, None, None), RowSparseLinear(linear, None, None)):
        restored = sparse.to_linear()
        assert torch.equal(restored.weight, weight) and torch.equal(restored.bias, bias)
        assert restored.weight.is_contiguous()
