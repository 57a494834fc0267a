import pytest
import torch

from sparsegen.pruning.masks import (
    check_sparsity,
    magnitude_scores,
    n_m_mask,
    parse_pattern,
    unstructured_mask,
    wanda_scores,
)


@pytest.fixture
def layer():
    torch.manual_seed(0)
    return torch.randn(16, 32), torch.rand(32) * 10  # weight, per-input sum of squares


def test_magnitude_per_layer_is_the_smallest_weights(layer):
    weight, _ = layer
    mask = unstructured_mask(magnitude_scores(weight), 0.5, per_row=False)
    smallest = sorted(range(weight.numel()), key=lambda i: abs(weight.flatten()[i].item()))[: weight.numel() // 2]
    expected = torch.zeros(weight.numel(), dtype=torch.bool)
    expected[smallest] = True
    assert torch.equal(mask, expected.view_as(weight))
    assert mask.sum().item() == weight.numel() // 2


def test_wanda_is_the_smallest_weight_times_input_norm_of_each_row(layer):
    weight, sq_sum = layer
    mask = unstructured_mask(wanda_scores(weight, sq_sum), 0.25, per_row=True)
    for row in range(weight.shape[0]):
        score = [abs(weight[row, j].item()) * sq_sum[j].sqrt().item() for j in range(weight.shape[1])]
        smallest = sorted(range(weight.shape[1]), key=score.__getitem__)[:8]
        assert mask[row].nonzero().flatten().tolist() == sorted(smallest)


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (1, 4)])
def test_n_m_masks_keep_exactly_n_of_every_m(layer, n, m):
    weight, sq_sum = layer
    scores = wanda_scores(weight, sq_sum)
    mask = n_m_mask(scores, n, m)
    groups = mask.view(weight.shape[0], -1, m)
    assert bool((groups.sum(-1) == m - n).all())
    kept_min = scores.view_as(groups).masked_fill(groups, float("inf")).min(-1).values
    dropped_max = scores.view_as(groups).masked_fill(~groups, float("-inf")).max(-1).values
    assert bool((dropped_max <= kept_min).all())


def test_sparsity_zero_prunes_nothing(layer):
    assert not unstructured_mask(magnitude_scores(layer[0]), 0.0, per_row=False).any()


@pytest.mark.parametrize("pattern", ["4:4", "3:2", "0:4", "a:b", "2-4"])
def test_bad_patterns(pattern):
    with pytest.raises(ValueError, match="N:M|N must"):
        parse_pattern(pattern)


@pytest.mark.parametrize("sparsity", [1.0, -0.1, 1.5])
def test_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        check_sparsity(sparsity)


def test_pattern_must_divide_the_input_dim():
    with pytest.raises(ValueError, match="multiple of 8"):
        n_m_mask(torch.rand(4, 12), 4, 8)
