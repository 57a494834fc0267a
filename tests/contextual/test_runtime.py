"""Sparse execution against reference implementations: the plain model with the same units zeroed by hooks."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from sparsegen.contextual import Contextual, attach, detach
from sparsegen.contextual.runtime import LowRankPredictor, model_info, predictor_name
from sparsegen.engine.generate import generate_tokens
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.anatomy import decoder_layers, head_families, mlp_layout
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import FAMILIES, VOCAB, tiny_model

IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def dejavu_plan(model, keep: float, heads: float | None = None) -> Contextual:
    """Random low-rank predictors keeping a fraction ``keep`` of neurons (and of heads)."""
    info = model_info(model)
    predictors, top_k = nn.ModuleDict(), []
    for index, neurons in enumerate(info["neurons"]):
        torch.manual_seed(index)
        predictors[predictor_name(index, "mlp")] = LowRankPredictor(info["hidden_size"], 4, neurons)
        k = {"mlp": max(1, round(keep * neurons))}
        if heads is not None:
            count = model.config.num_attention_heads
            predictors[predictor_name(index, "heads")] = LowRankPredictor(info["hidden_size"], 4, count)
            k["heads"] = max(1, round(heads * count))
        top_k.append(k)
    return Contextual("dejavu", info, top_k, predictors)


def teal_plan(model, threshold: float) -> Contextual:
    thresholds = {f"{index}.{path}": threshold for index, layer in enumerate(decoder_layers(model))
                  for path, module in layer.named_modules() if isinstance(module, nn.Linear)}
    return Contextual("teal", model_info(model), thresholds=thresholds)


def _top_k(scores, k):
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(k, -1).indices, True)


def zeroing_hooks(model, plan: Contextual) -> list:
    """The reference: the dense model, with the plan's units zeroed at the inputs of the layers that use them."""
    layers, handles, masks = decoder_layers(model), [], {}
    if plan.method == "teal":
        for index, layer in enumerate(layers):
            for path, module in layer.named_modules():
                if isinstance(module, nn.Linear):
                    t = plan.thresholds[f"{index}.{path}"]
                    handles.append(module.register_forward_pre_hook(lambda m, a, t=t: (a[0] * (a[0].abs() >= t),)))
        return handles

    def predict(target, hidden):
        for kind in ("mlp", "heads"):
            name = predictor_name(target, kind)
            if name in plan.predictors:
                masks[(target, kind)] = _top_k(plan.predictors[name](hidden), plan.top_k[target][kind])

    def before(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            for target in ([0] if index == 0 else []) + ([index + 1] if index + 1 < len(layers) else []):
                predict(target, hidden)
        return hook

    def zero_neurons(index):
        return lambda m, a: (a[0] * masks[(index, "mlp")].reshape(*a[0].shape[:-1], -1),)

    def zero_heads(index, head_dim):
        return lambda m, a: (a[0] * masks[(index, "heads")].repeat_interleave(head_dim, -1),)

    consumer = mlp_layout(model.config.model_type)[1]
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(index), with_kwargs=True))
        handles.append(layer.get_submodule(consumer).register_forward_pre_hook(zero_neurons(index)))
        if predictor_name(index, "heads") in plan.predictors:
            attention = layer.self_attn
            handles.append(attention.o_proj.register_forward_pre_hook(zero_heads(index, attention.head_dim)))
    return handles


def _reference_logits(model, plan, ids):
    handles = zeroing_hooks(model, plan)
    try:
        return model(ids).logits
    finally:
        for handle in handles:
            handle.remove()


def _decode_logits(model, ids, cache):
    """Prefill the first 8 tokens, then one token per step (teacher forced): logits at every position."""
    logits = [model(ids[:, :8], **cache_kwargs(cache)).logits]
    for position in range(8, ids.shape[1]):
        logits.append(model(ids[:, position:position + 1], **cache_kwargs(cache)).logits)
    return torch.cat(logits, dim=1)


def _plans(family, model):
    heads = 0.5 if family in head_families() else None
    return {"dejavu": dejavu_plan(model, 0.3, heads), "teal": teal_plan(model, 0.5)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_unit_chosen_equals_the_dense_model(family):
    model = tiny_model(family)
    with torch.no_grad():
        dense = model(IDS).logits
        dense_steps = _decode_logits(model, IDS, DynamicCache(config=model.config))
        for plan in (dejavu_plan(model, 1.0, 1.0 if family in head_families() else None), teal_plan(model, 0.0)):
            attach(model, plan)
            torch.testing.assert_close(model(IDS).logits, dense, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(_decode_logits(model, IDS, DynamicCache(config=model.config)), dense_steps,
                                       rtol=1e-5, atol=1e-5)
            detach(model)
    torch.testing.assert_close(model(IDS).logits, dense, rtol=0, atol=0)  # detach restores the model exactly


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method", ["dejavu", "teal"])
def test_chosen_units_equal_the_dense_model_with_the_rest_zeroed(family, method):
    model = tiny_model(family)
    plan = _plans(family, model)[method]
    with torch.no_grad():
        reference = _reference_logits(model, plan, IDS)
        dense = model(IDS).logits
        attach(model, plan)
        masked = model(IDS).logits
        decoded = _decode_logits(model, IDS, DynamicCache(config=model.config))  # gathered weights at decode
        detach(model)
    assert (masked - dense).abs().max() > 1e-3  # the plan really drops work
    torch.testing.assert_close(masked, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoded, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_composes_with_eviction(policy):
    model = tiny_model("llama")
    ids, mask = IDS, torch.ones_like(IDS)

    def run():
        new, counts, stats, _, _ = generate_tokens(model, ids, mask, make_policy(policy, 12), max_new_tokens=10,
                                                   chunk_size=8)
        return new, stats

    plain, plain_stats = run()
    attach(model, dejavu_plan(model, 1.0, 1.0))
    full, _ = run()
    detach(model)
    assert torch.equal(full, plain)  # every unit chosen: the same tokens under eviction
    attach(model, dejavu_plan(model, 0.25, 0.5))
    sparse, stats = run()
    detach(model)
    assert sparse.shape == plain.shape and stats["kv_tokens_peak"] == plain_stats["kv_tokens_peak"]
    # and the decode steps match the masked reference under the same eviction cache
    plan = dejavu_plan(model, 0.25, 0.5)
    with torch.no_grad():
        handles = zeroing_hooks(model, plan)
        reference = _decode_logits(model, IDS, EvictionCache(model, make_policy(policy, 12), chunk_size=8))
        for handle in handles:
            handle.remove()
        attach(model, plan)
        decoded = _decode_logits(model, IDS, EvictionCache(model, make_policy(policy, 12), chunk_size=8))
        detach(model)
    torch.testing.assert_close(decoded, reference, rtol=1e-4, atol=1e-4)


def test_save_load_round_trip(tmp_path):
    model = tiny_model("llama")
    for method, plan in _plans("llama", model).items():
        folder = plan.save(tmp_path / method)
        loaded = Contextual.load(folder)
        assert loaded.method == method and loaded.top_k == plan.top_k and loaded.thresholds == plan.thresholds
        with torch.no_grad():
            attach(model, plan)
            expected = model(IDS).logits
            detach(model)
            attach(model, loaded)
            torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=0)
            detach(model)


def test_bad_plans_get_clear_errors(tmp_path):
    model = tiny_model("llama")
    plan = dejavu_plan(model, 0.5)
    with pytest.raises(FileNotFoundError, match="contextual fit"):
        Contextual.load(tmp_path / "missing")
    folder = plan.save(tmp_path / "plan")
    (folder / "predictors.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="fit them again"):
        Contextual.load(folder)
    other = tiny_model("qwen3")  # a different head_dim and model type
    with pytest.raises(ValueError, match="was fit for model_type llama"):
        attach(other, plan)
    attach(model, plan)
    with pytest.raises(ValueError, match="already runs"):
        attach(model, plan)


def test_suspended_runs_dense_and_fidelity_compares_with_the_dense_model():
    from sparsegen.contextual.runtime import suspended
    from sparsegen.eval.fidelity import fidelity
    from sparsegen.kv import PolicySpec

    model = tiny_model("llama")
    with torch.no_grad():
        dense = model(IDS).logits
        attach(model, teal_plan(model, 0.5))
        with suspended(model):
            torch.testing.assert_close(model(IDS).logits, dense, rtol=1e-5, atol=1e-5)
            suspended_steps = _decode_logits(model, IDS, DynamicCache(config=model.config))
        detached_steps = _decode_logits(detach(model), IDS, DynamicCache(config=model.config))
        torch.testing.assert_close(suspended_steps, detached_steps, rtol=1e-5, atol=1e-5)
        attach(model, teal_plan(model, 0.5))
        assert (model(IDS).logits - dense).abs().max() > 1e-3  # back on after the block

    class Tokens:
        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, row.tolist())) for row in rows]

    sparse = fidelity(model, Tokens(), IDS, PolicySpec(), new_tokens=6, progress=False)
    detach(model)
    same = fidelity(model, Tokens(), IDS, PolicySpec(), new_tokens=6, progress=False)
    assert same["kl"] < 1e-6 and same["rouge_l"] == 1.0
    assert sparse["kl"] > 1e-4  # the plan's model against the dense one


def test_a_quantized_model_is_refused_before_fitting_or_running_a_plan():
    """Fitting used to fail deep inside with "min() arg is an empty sequence"; both now name the fix."""
    from sparsegen.contextual.teal import fit_teal
    from sparsegen.quant.quantize import QuantizeConfig, quantize_model

    model = tiny_model("llama")
    quantize_model(model, QuantizeConfig(bits=4, group_size=0, method="rtn"), progress=False)
    ids = torch.randint(3, VOCAB, (2, 16))
    with pytest.raises(ValueError, match="float .*checkpoint"):
        fit_teal(model, ids, 0.5)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_model_packed_for_the_low_bit_kernels_is_refused(weights):
    """``--weights int8|int4`` re-stores the linears as packed kernels, which have no float rows to gather: TEAL used to
    find no linear to threshold and run dense without a word."""
    from transformers import LlamaForCausalLM

    from sparsegen.contextual.teal import fit_teal
    from sparsegen.quant.restore import quantize_weights
    from tests.conftest import tiny_llama_config

    model = quantize_weights(LlamaForCausalLM(tiny_llama_config(320)).eval(), weights)
    with pytest.raises(ValueError, match="--weights fp32"):
        fit_teal(model, torch.randint(3, 320, (2, 16)), 0.5)
    with pytest.raises(ValueError, match="--weights fp32"):
        attach(model, None)  # (refused before the plan is read)


def test_a_method_of_your_own_is_one_registered_class(monkeypatch, tmp_path):
    """A method registers itself, wires the layers it names and runs before each layer; a saved plan names it and
    loads back; the model runs as the reference zeroing the same units."""
    from sparsegen.contextual.layers import ColumnSparseLinear
    from sparsegen.contextual.runtime import CONTEXTUAL_METHODS, ContextualMethod, register_contextual_method

    class EvenInputs:  # a ``layers.Selection``: the down projection's even inputs only
        def mask(self, x):
            return (torch.arange(x.shape[-1]) % 2 == 0).expand(x.shape)

        def union(self):
            return None

    seen = []

    class EveryOther(ContextualMethod):
        name = "every-other"

        def wire(self, plan, forward, index, layer, swap):
            path = mlp_layout(forward.model_type)[1]
            swap(layer, path, ColumnSparseLinear(layer.get_submodule(path), EvenInputs(), forward.decoding))

        def before_layer(self, plan, forward, index, hidden, layers):
            seen.append((index, layers))

    monkeypatch.setitem(CONTEXTUAL_METHODS, "every-other", None)  # (removed again after the test)
    register_contextual_method(EveryOther)
    model = tiny_model("llama")
    path = mlp_layout("llama")[1]
    handles = [layer.get_submodule(path).register_forward_pre_hook(
        lambda m, a: (a[0] * (torch.arange(a[0].shape[-1]) % 2 == 0),)) for layer in decoder_layers(model)]
    with torch.no_grad():
        expected = model(IDS).logits
    for handle in handles:
        handle.remove()
    plan = Contextual.load(Contextual("every-other", model_info(model)).save(tmp_path / "plan"))
    attach(model, plan)
    with torch.no_grad():
        got = model(IDS).logits
    layers = len(decoder_layers(model))
    assert seen == [(index, layers) for index in range(layers)]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    detach(model)
    with pytest.raises(TypeError, match="ContextualMethod subclass"):
        register_contextual_method(object)
