"""Running a model with contextual sparsity: what a fitted folder holds, and how it hooks into a model.

A folder written by ``sparsegen contextual fit`` holds ``contextual.json`` (method, per-layer sizes and the
measured recall/precision or sparsity) and, for Deja Vu, ``predictors.safetensors``. ``attach`` swaps the
decoder layers' linears for the sparse ones in ``layers.py`` and adds one forward pre-hook per decoder layer:

- Deja Vu: layer l's hook reads the residual stream entering layer l and predicts which MLP neurons (and
  heads) layer l+1 will need — the lookahead; layer 0 is predicted from its own input. Each token keeps the
  top-K units by predictor score.
- TEAL: no predictor; every linear with a threshold keeps the inputs whose magnitude is at least it.

Skipped heads still get their K and V computed and cached: a head skipped for this token may be chosen by a
later one, and it must then see the whole history. The cost is the K/V projections and the cache of every
head; what is saved is the skipped heads' queries, their share of the output projection, and nothing of the
attention itself (it runs for all heads, the skipped heads' results are dropped).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.layers import ColumnSparseLinear, RowSparseLinear
from sparsegen.models.anatomy import decoder_layers, head_families, mlp_layout, neuron_count
from sparsegen.models.families import family

METHODS = ("dejavu", "teal")
CONFIG = "contextual.json"
WEIGHTS = "predictors.safetensors"


def predictor_name(layer: int, kind: str) -> str:
    """``mlp3``/``heads3``: the key of layer 3's predictor (module names cannot hold dots)."""
    return f"{kind}{layer}"


class LowRankPredictor(nn.Module):
    """Deja Vu's classifier: ``hidden -> rank -> units`` with no nonlinearity, on the RMS-normalised residual."""

    def __init__(self, hidden: int, rank: int, units: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(F.rms_norm(x, (x.shape[-1],), eps=1e-6)))


@dataclass
class Contextual:
    """A fitted contextual-sparsity plan for one model."""

    method: str
    info: dict  # model type and sizes it was fit for, calibration, per-layer measurements
    top_k: list[dict[str, int]] = field(default_factory=list)  # dejavu: per layer {"mlp": K, "heads": K}
    predictors: nn.ModuleDict = field(default_factory=nn.ModuleDict)  # dejavu: predictor_name -> LowRankPredictor
    thresholds: dict[str, float] = field(default_factory=dict)  # teal: "layer.path" -> |x| threshold

    def save(self, folder: str | Path, overwrite: bool = False) -> Path:
        from safetensors.torch import save_file

        from sparsegen.output import new_folder

        ranks = {name: p.down.out_features for name, p in self.predictors.items()}
        with new_folder(folder, overwrite) as work:
            (work / CONFIG).write_text(json.dumps({"method": self.method, "top_k": self.top_k, "ranks": ranks,
                                                   "thresholds": self.thresholds, **self.info}, indent=2))
            if self.method == "dejavu":
                state = {k: v.detach().float().contiguous() for k, v in self.predictors.state_dict().items()}
                save_file(state, work / WEIGHTS)
        return Path(folder)

    @classmethod
    def load(cls, folder: str | Path) -> Contextual:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / CONFIG).is_file():
            raise FileNotFoundError(f"{folder} has no {CONFIG}; make one with `sparsegen contextual fit ... --out "
                                    f"{folder}`")
        try:
            info = json.loads((folder / CONFIG).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{folder / CONFIG} is not valid JSON ({error}); fit it again") from None
        method = info.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"{folder / CONFIG} names method {method!r}; expected one of {', '.join(METHODS)}")
        top_k, ranks, thresholds = info.pop("top_k", []), info.pop("ranks", {}), info.pop("thresholds", {})
        predictors = nn.ModuleDict()
        if method == "dejavu":
            try:
                state = load_file(folder / WEIGHTS)
            except (FileNotFoundError, SafetensorError, OSError) as error:
                raise ValueError(f"cannot read the predictors in {folder / WEIGHTS} ({error}); fit them "
                                 f"again") from None
            for name, rank in ranks.items():
                up = state.get(f"{name}.up.weight")
                if up is None:
                    raise ValueError(f"{folder / WEIGHTS} lacks the predictor {name!r}; fit it again")
                predictors[name] = LowRankPredictor(state[f"{name}.down.weight"].shape[1], rank, up.shape[0])
            predictors.load_state_dict(state)
        return cls(method, info, top_k, predictors, thresholds)

    def check(self, model: nn.Module) -> None:
        """Refuse a plan fit for a different model."""
        for key, value in model_info(model).items():
            if self.info.get(key) != value:
                raise ValueError(f"this contextual plan was fit for {key} {self.info.get(key)}, but the model has "
                                 f"{value}; fit one for this model with `sparsegen contextual fit`")


def model_info(model: nn.Module) -> dict:
    config = model.config.get_text_config()
    layers = decoder_layers(model)
    return {"model_type": config.model_type, "hidden_size": config.hidden_size, "layers": len(layers),
            "neurons": [neuron_count(layer, config.model_type) for layer in layers]}


class _Step:
    """What the layers of one forward share: whether it decodes, and each layer's predicted top-K."""

    def __init__(self):
        self.enabled = True  # False inside ``suspended``: every layer runs dense
        self.decode = False
        self.top: dict[tuple[int, str], torch.Tensor] = {}  # [B, T, K] unit indices
        self.masks: dict[tuple[int, str], torch.Tensor] = {}  # built from ``top`` when a layer asks
        self.units: dict[tuple[int, str], torch.Tensor] = {}  # decode: sorted union over the batch
        self.sizes: dict[tuple[int, str], int] = {}  # units per layer and kind

    def clear(self, decode: bool) -> None:
        self.decode = decode
        self.top.clear(), self.masks.clear(), self.units.clear()


class _Predicted:
    """The units a Deja Vu predictor chose for one layer (a ``layers.Selection``)."""

    def __init__(self, step: _Step, key: tuple[int, str]):
        self.step, self.key = step, key

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.step.enabled:
            return None
        mask = self.step.masks.get(self.key)
        if mask is None:
            top = self.step.top[self.key]
            mask = torch.zeros(*top.shape[:-1], self.step.sizes[self.key], dtype=torch.bool, device=top.device)
            mask = self.step.masks[self.key] = mask.scatter_(-1, top, True)
        return mask

    def union(self) -> torch.Tensor | None:
        return self.step.units.get(self.key)


class _Threshold:
    """TEAL: the inputs whose magnitude reaches the threshold (a ``layers.Selection``)."""

    def __init__(self, step: _Step, threshold: float):
        self.step, self.threshold = step, threshold

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        return x.abs() >= self.threshold if self.step.enabled else None

    def union(self) -> None:
        return None


def _hidden(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def check_float_weights(model: nn.Module) -> None:
    """Contextual sparsity gathers rows and columns of float weights: a quantized checkpoint is refused."""
    from sparsegen.quant import QuantLinear
    from sparsegen.quant.restore import PACKED_LINEARS

    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("contextual sparsity gathers rows and columns of float weights, and this checkpoint is "
                         "quantized; fit and run the plan on the float (optionally pruned) checkpoint")
    if any(isinstance(m, PACKED_LINEARS) for m in model.modules()):
        raise ValueError("contextual sparsity gathers rows and columns of float weights, and this model's linears "
                         "are packed for the int8/int4/w8a8 kernels; run the plan with --weights fp32")


def attach(model: nn.Module, plan: Contextual) -> nn.Module:
    """Make ``model`` run with ``plan``'s contextual sparsity (in place; ``detach`` undoes it)."""
    if getattr(model, "_sparsegen_contextual", None) is not None:
        raise ValueError("this model already runs with a contextual plan; detach it first")
    check_float_weights(model)
    plan.check(model)
    param = next(model.parameters())
    plan.predictors.to(device=param.device, dtype=param.dtype)
    model_type = model.config.model_type
    producers, consumer = mlp_layout(model_type)
    layers = decoder_layers(model)
    step = _Step()
    decoding = lambda: step.decode  # noqa: E731
    swapped: list[tuple[nn.Module, str]] = []

    def swap(parent: nn.Module, path: str, module: nn.Module) -> None:
        owner_path, _, name = path.rpartition(".")
        owner = parent.get_submodule(owner_path) if owner_path else parent
        swapped.append((owner, name))
        setattr(owner, name, module)  # the dense linear goes: no second copy of its weights stays alive

    for index, layer in enumerate(layers):
        if plan.method == "teal":
            for path, linear in [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]:
                threshold = plan.thresholds.get(f"{index}.{path}")
                if threshold is not None:  # linears without one stay dense (TEAL fit with targets="mlp")
                    swap(layer, path, ColumnSparseLinear(linear, _Threshold(step, threshold), decoding))
            continue
        neurons, size = _Predicted(step, (index, "mlp")), neuron_count(layer, model_type)
        step.sizes[(index, "mlp")] = size
        for path in producers:
            linear = layer.get_submodule(path)
            swap(layer, path, RowSparseLinear(linear, neurons, decoding, copies=linear.out_features // size))
        swap(layer, consumer, ColumnSparseLinear(layer.get_submodule(consumer), neurons, decoding))
        if predictor_name(index, "heads") in plan.predictors:
            heads, attention = _Predicted(step, (index, "heads")), layer.self_attn
            step.sizes[(index, "heads")] = attention.q_proj.out_features // attention.head_dim
            swap(layer, "self_attn.q_proj", RowSparseLinear(attention.q_proj, heads, decoding, attention.head_dim))
            swap(layer, "self_attn.o_proj", ColumnSparseLinear(attention.o_proj, heads, decoding, attention.head_dim))

    def predict(index: int, hidden: torch.Tensor) -> None:
        for kind in ("mlp", "heads"):
            name = predictor_name(index, kind)
            if name in plan.predictors:
                top = plan.predictors[name](hidden).topk(plan.top_k[index][kind], dim=-1).indices
                step.top[(index, kind)] = top
                if step.decode:
                    step.units[(index, kind)] = top.flatten().unique()  # sorted

    def before_layer(index: int):
        def hook(module, args, kwargs):
            hidden = _hidden(args, kwargs)
            if index == 0:
                step.clear(decode=step.enabled and hidden.dim() == 3 and hidden.shape[1] == 1)
            if plan.method == "dejavu" and step.enabled:
                with torch.no_grad():
                    if index == 0:
                        predict(0, hidden)
                    if index + 1 < len(layers):
                        predict(index + 1, hidden)  # lookahead: layer l's input chooses layer l+1's units
        return hook

    handles = [layer.register_forward_pre_hook(before_layer(i), with_kwargs=True) for i, layer in enumerate(layers)]
    model._sparsegen_contextual = (plan, step, swapped, handles)
    return model


def attached_plan(model: nn.Module) -> Contextual | None:
    attached = getattr(model, "_sparsegen_contextual", None)
    return None if attached is None else attached[0]


@contextmanager
def suspended(model: nn.Module):
    """Run ``model`` dense inside the block although a plan is attached (the reference that fidelity compares with)."""
    attached = getattr(model, "_sparsegen_contextual", None)
    if attached is None:
        yield model
        return
    step = attached[1]
    step.enabled = False
    try:
        yield model
    finally:
        step.enabled = True


def detach(model: nn.Module) -> nn.Module:
    """Undo ``attach``: the model's own dense linears come back (weights re-laid out, values unchanged)."""
    attached = getattr(model, "_sparsegen_contextual", None)
    if attached is None:
        return model
    _, _, swapped, handles = attached
    for handle in handles:
        handle.remove()
    for owner, name in swapped:
        setattr(owner, name, getattr(owner, name).to_linear())
    model._sparsegen_contextual = None
    return model


def check_heads(model: nn.Module) -> None:
    model_type = model.config.model_type
    if not family(model_type).separate_heads:
        raise ValueError(f"skipping heads needs separate q/o projections ({', '.join(head_families())}); "
                         f"{model_type} fuses its attention. Fit MLP predictors only (--heads 0)")
