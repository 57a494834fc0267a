"""How sparse a model's computation is for a given input (Deja Vu's observation), and how slowly its residual
stream changes from layer to layer (what lets a predictor read layer l's input to guess layer l+1's sparsity).

Per layer and token: the MLP's neuron activations are the inputs of its down projection (ReLU models leave
exact zeros there); a head's contribution is the norm of its slice of the output projection's input. The
"sparsity at mass m" is the fraction of neurons (heads) a token can drop while the ones kept still carry a
fraction m of the total |activation| (head-output norm), averaged over tokens.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from sparsegen.models.anatomy import decoder_layers, mlp_layout


def needed_fraction(values: torch.Tensor, mass: float) -> torch.Tensor:
    """Per row of ``values`` ``[tokens, units]`` (non-negative): the fraction of units, largest first, whose sum
    reaches ``mass`` of the row's total."""
    ordered = values.float().sort(dim=-1, descending=True).values
    total = ordered.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    reached = ordered.cumsum(-1) / total >= mass * (1 - 1e-6)
    first = reached.float().argmax(-1)  # index of the first unit at which the mass is reached
    return (first + 1).float() / values.shape[-1]


@torch.no_grad()
def contextual_statistics(model: torch.nn.Module, ids: torch.Tensor, mass: float = 0.95, batch_size: int = 8,
                          progress: bool = True) -> dict:
    """Per-layer MLP and head sparsity at ``mass`` and the cosine similarity of consecutive residual streams."""
    if not 0 < mass <= 1:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    model_type = model.config.model_type
    layers = decoder_layers(model)
    consumer_path = mlp_layout(model_type)[1]
    totals = [{"tokens": 0, "zero": 0.0, "mlp": 0.0, "heads": 0.0, "cosine": 0.0} for _ in layers]
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def keep(index: int, name: str):
        def hook(module, args):
            captured[(index, name)] = args[0].detach().reshape(-1, args[0].shape[-1])
        return hook

    handles, with_heads = [], set()
    for index, layer in enumerate(layers):
        handles.append(layer.get_submodule(consumer_path).register_forward_pre_hook(keep(index, "mlp")))
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "o_proj"):  # Llama-style attention: heads side by side
            handles.append(attention.o_proj.register_forward_pre_hook(keep(index, "heads")))
            with_heads.add(index)
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, len(ids), batch_size), desc="statistics", disable=not progress, leave=False):
            batch = ids[start:start + batch_size].to(device)
            hidden = model(input_ids=batch, output_hidden_states=True, use_cache=False).hidden_states
            for index, total in enumerate(totals):
                activations = captured[(index, "mlp")].abs()
                total["tokens"] += len(activations)
                total["zero"] += (activations == 0).float().mean(-1).sum().item()
                total["mlp"] += (1 - needed_fraction(activations, mass)).sum().item()
                if (index, "heads") in captured:
                    head_out = captured[(index, "heads")]
                    head_dim = layers[index].self_attn.head_dim
                    norms = head_out.view(len(head_out), -1, head_dim).norm(dim=-1)
                    total["heads"] += (1 - needed_fraction(norms, mass)).sum().item()
                if index + 1 < len(layers):  # the model's last hidden state is after its final norm
                    before, after = hidden[index].flatten(0, 1), hidden[index + 1].flatten(0, 1)
                    total["cosine"] += torch.cosine_similarity(before.float(), after.float(), dim=-1).sum().item()
            captured.clear()
    finally:
        for handle in handles:
            handle.remove()
    per_layer = [{
        "layer": index,
        "mlp_zero_fraction": t["zero"] / t["tokens"],
        "mlp_sparsity": t["mlp"] / t["tokens"],
        "head_sparsity": t["heads"] / t["tokens"] if index in with_heads else None,
        "residual_cosine": t["cosine"] / t["tokens"] if index + 1 < len(layers) else None,
    } for index, t in enumerate(totals)]
    return {"mass": mass, "tokens": totals[0]["tokens"], "layers": per_layer}
