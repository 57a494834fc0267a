import pytest
import torch

from sparsegen.models import ModelLoadError, load, load_config, model_spec
from sparsegen.models.synthetic import PRESETS, random_model

# parameter counts of the public checkpoints each preset copies
PUBLIC_PARAMS = {
    "llama-1b": 1_235_814_400, "llama-3b": 3_212_749_824, "llama2-7b": 6_738_415_616, "mistral-7b": 7_248_023_552,
    "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "pythia-1b": 1_011_781_632, "opt-1.3b": 1_315_758_080,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_the_public_shapes(name):
    spec = model_spec(f"random:{name}")
    assert spec.params == PUBLIC_PARAMS[name]
    assert spec.name == f"random:{name}"


def test_random_model_from_a_checkpoint_config(tiny_checkpoint):
    model = random_model(load_config(f"random:{tiny_checkpoint}"), seed=1)
    weights = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
    assert 0.015 < weights["model.layers.0.mlp.up_proj.weight"].std().item() < 0.025
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(model(ids).logits).all()
    again = random_model(load_config(f"random:{tiny_checkpoint}"), seed=1)
    assert torch.equal(again.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_random_models_cannot_be_loaded_for_text():
    with pytest.raises(ModelLoadError, match="random weights and no tokenizer"):
        load("random:llama-1b")
