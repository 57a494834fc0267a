"""Running calibration text through a model and keeping, per decoder layer, what contextual sparsity is fit on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from sparsegen.models.anatomy import decoder_layers, mlp_layout


@dataclass
class Capture:
    """Per layer, rows are tokens in calibration order (window after window)."""

    inputs: list[torch.Tensor] = field(default_factory=list)  # [N, hidden]: the residual stream entering the layer
    neurons: list[torch.Tensor] = field(default_factory=list)  # [N, neurons]: |MLP activation| (down-proj input)
    heads: list[torch.Tensor | None] = field(default_factory=list)  # [N, heads]: norm of each head's output
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)  # "layer.path" -> sample of |linear input|


@torch.no_grad()
def capture(model: nn.Module, ids: torch.Tensor, *, predictors: bool, magnitudes: bool, batch_size: int = 8,
            sample_per_linear: int = 1 << 22, seed: int = 0, progress: bool = True) -> Capture:
    """Run ``ids`` ``[windows, seqlen]`` through ``model``; keep predictor data and/or linear-input magnitudes."""
    from sparsegen.contextual.runtime import check_float_weights

    check_float_weights(model)  # (what is fit here must run there)
    layers = decoder_layers(model)
    consumer = mlp_layout(model.config.model_type)[1]
    kept: dict[tuple, list[torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(seed)
    per_batch = max(1, sample_per_linear * batch_size // max(len(ids), 1))

    def keep(key, transform):
        def hook(module, args, kwargs=None):
            x = args[0] if args else kwargs["hidden_states"]
            kept.setdefault(key, []).append(transform(x.detach().reshape(-1, x.shape[-1]).float()).cpu())
        return hook

    def sample(x: torch.Tensor) -> torch.Tensor:
        flat = x.abs().flatten()
        if len(flat) <= per_batch:
            return flat
        return flat[torch.randint(len(flat), (per_batch,), generator=generator).to(flat.device)]

    handles = []
    for index, layer in enumerate(layers):
        if predictors:
            handles.append(layer.register_forward_pre_hook(keep(("inputs", index), lambda x: x), with_kwargs=True))
            handles.append(layer.get_submodule(consumer).register_forward_pre_hook(keep(("neurons", index), torch.abs)))
            attention = getattr(layer, "self_attn", None)
            if attention is not None and hasattr(attention, "o_proj"):
                head_dim = attention.head_dim
                norms = lambda x, d=head_dim: x.view(len(x), -1, d).norm(dim=-1)  # noqa: E731
                handles.append(attention.o_proj.register_forward_pre_hook(keep(("heads", index), norms)))
        if magnitudes:
            for path, linear in layer.named_modules():
                if isinstance(linear, nn.Linear):
                    handles.append(linear.register_forward_pre_hook(keep(("linear", f"{index}.{path}"), sample)))
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, len(ids), batch_size), desc="calibration", disable=not progress, leave=False):
            model(input_ids=ids[start:start + batch_size].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    joined = {key: torch.cat(parts) for key, parts in kept.items()}
    result = Capture(magnitudes={key[1]: value for key, value in joined.items() if key[0] == "linear"})
    if predictors:
        result.inputs = [joined[("inputs", i)] for i in range(len(layers))]
        result.neurons = [joined[("neurons", i)] for i in range(len(layers))]
        result.heads = [joined.get(("heads", i)) for i in range(len(layers))]
    return result
