import pytest
import torch

from sparsegen.pruning.masks import magnitude_scores, n_m_mask, unstructured_mask, wanda_scores
from sparsegen.pruning.sparsegpt import HessianError, sparsegpt_prune


@pytest.fixture(scope="module")
def layer():
    """A random layer and correlated calibration inputs (a few strong shared directions plus noise)."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    x = torch.randn(2048, 8) @ torch.randn(8, 64) * 2 + 0.3 * torch.randn(2048, 64)
    return weight, x


def _error(weight, pruned, x):
    return ((x @ weight.T - x @ pruned.T).norm() / (x @ weight.T).norm()).item()


def test_sparsegpt_reconstructs_better_than_wanda_and_magnitude(layer):
    weight, x = layer
    hessian = 2 * x.T @ x / len(x)
    sparse, _ = sparsegpt_prune(weight, hessian, sparsity=0.5, block_size=16)
    wanda = weight.masked_fill(unstructured_mask(wanda_scores(weight, x.pow(2).sum(0)), 0.5, per_row=True), 0)
    magnitude = weight.masked_fill(unstructured_mask(magnitude_scores(weight), 0.5, per_row=False), 0)
    errors = {name: _error(weight, w, x) for name, w in (("sparsegpt", sparse), ("wanda", wanda),
                                                          ("magnitude", magnitude))}
    assert errors["sparsegpt"] < errors["wanda"] and errors["sparsegpt"] < errors["magnitude"], errors
    assert (sparse == 0).float().mean().item() == pytest.approx(0.5, abs=1e-9)


def test_sparsegpt_at_zero_sparsity_returns_the_weights(layer):
    weight, x = layer
    same, _ = sparsegpt_prune(weight, 2 * x.T @ x / len(x), sparsity=0.0)
    assert torch.equal(same, weight)


def test_sparsegpt_n_m(layer):
    weight, x = layer
    pruned, _ = sparsegpt_prune(weight, 2 * x.T @ x / len(x), pattern=(2, 4), block_size=16)
    assert bool(((pruned == 0).view(48, -1, 4).sum(-1) == 2).all())
    wanda = weight.masked_fill(n_m_mask(wanda_scores(weight, x.pow(2).sum(0)), 2, 4), 0)
    assert _error(weight, pruned, x) < _error(weight, wanda, x)


def test_dead_inputs_and_singular_hessians(layer):
    weight, x = layer
    x = x.clone()
    x[:, 5] = 0  # an input that is never active
    pruned, _ = sparsegpt_prune(weight, 2 * x.T @ x / len(x), sparsity=0.5)
    assert bool((pruned[:, 5] == 0).all()) and torch.isfinite(pruned).all()
    with pytest.raises(HessianError, match="not positive definite"):
        sparsegpt_prune(weight, -torch.eye(64), sparsity=0.5)
