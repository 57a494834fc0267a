"""Running a model with contextual sparsity: what a fitted folder holds, and how it hooks into a model.

A folder written by ``sparsegen contextual fit`` holds ``contextual.json`` (method, per-layer sizes and the
measured recall/precision or sparsity) and, for a method with predictors (Deja Vu), ``predictors.safetensors``.
``attach`` swaps the decoder layers' linears for the sparse ones in ``layers.py`` and adds one forward pre-hook per
decoder layer:

- Deja Vu (``dejavu.py``): layer l's hook reads the residual stream entering layer l and predicts which MLP
  neurons (and heads) layer l+1 will need — the lookahead; layer 0 is predicted from its own input. Each token
  keeps the top-K units by predictor score.
- TEAL (``teal.py``): no predictor; every linear with a threshold keeps the inputs whose magnitude is at least it.

Each method is a ``ContextualMethod`` that registers itself (``register_contextual_method``: in a file of its own,
``sparsegen --plugin FILE contextual fit ...``, or from an installed package through the
``sparsegen.contextual_methods`` entry point group) and wires its layers; this file does what all share.

Skipped heads still get their K and V computed and cached: a head skipped for this token may be chosen by a
later one, and it must then see the whole history. The cost is the K/V projections and the cache of every
head; what is saved is the skipped heads' queries, their share of the output projection, and nothing of the
attention itself (it runs for all heads, the skipped heads' results are dropped).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.models.anatomy import decoder_layers, head_families, neuron_count
from sparsegen.models.families import family
from sparsegen.plugins import from_entry_points

CONFIG = "contextual.json"
WEIGHTS = "predictors.safetensors"
ENTRY_POINTS = "sparsegen.contextual_methods"


class Forward:
    """What the layers of one forward share: whether it decodes, and what a method computed for its layers."""

    def __init__(self, model_type: str):
        self.model_type = model_type  # the model's (``models.anatomy`` reads its layers by it)
        self.enabled = True  # False inside ``suspended``: every layer runs dense
        self.decode = False
        self.top: dict[tuple[int, str], torch.Tensor] = {}  # (layer, kind) -> [B, T, K] unit indices
        self.masks: dict[tuple[int, str], torch.Tensor] = {}  # built from ``top`` when a layer asks
        self.units: dict[tuple[int, str], torch.Tensor] = {}  # decode: sorted union over the batch
        self.sizes: dict[tuple[int, str], int] = {}  # units per layer and kind

    def clear(self, decode: bool) -> None:
        self.decode = decode
        self.top.clear(), self.masks.clear(), self.units.clear()

    def decoding(self) -> bool:
        return self.decode


# swap(layer, path, module): put ``module`` at ``path`` in ``layer`` (``detach`` puts the dense linear back)
Swap = Callable[[nn.Module, str, nn.Module], None]


class ContextualMethod:
    """A rule for which units of a layer an input needs. ``options``: its fit's own keyword options (the flags of
    ``sparsegen contextual fit`` it takes); ``calibration_windows``: the windows of calibration text it reads by
    default."""

    name: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()
    calibration_windows: ClassVar[int] = 32

    def fit(self, model: nn.Module, ids: torch.Tensor, batch_size: int = 8, seed: int = 0, progress: bool = True,
            **options) -> Contextual:
        raise NotImplementedError

    def summary(self, plan: Contextual) -> list[str]:
        """What a fit reports, as lines of text."""
        return []

    def wire(self, plan: Contextual, forward: Forward, index: int, layer: nn.Module, swap: Swap) -> None:
        """Swap layer ``index``'s linears for the sparse ones of ``contextual.layers``."""
        raise NotImplementedError

    def before_layer(self, plan: Contextual, forward: Forward, index: int, hidden: torch.Tensor, layers: int) -> None:
        """Runs as layer ``index`` (of ``layers``) receives ``hidden``, while ``forward.enabled``."""


CONTEXTUAL_METHODS: dict[str, ContextualMethod] = {}


def register_contextual_method(cls: type[ContextualMethod]) -> type[ContextualMethod]:
    """Class decorator: make a method available by its ``name`` (``sparsegen contextual fit --method``, the plans a
    folder names)."""
    if not (isinstance(cls, type) and issubclass(cls, ContextualMethod)) \
            or not isinstance(getattr(cls, "name", None), str):
        raise TypeError("register_contextual_method takes a ContextualMethod subclass with a name")
    CONTEXTUAL_METHODS[cls.name] = cls()
    return cls


def contextual_method(name: str) -> ContextualMethod:
    """The registered method called ``name`` (looking in installed packages' entry points if it is not yet)."""
    if name not in CONTEXTUAL_METHODS and (found := from_entry_points(ENTRY_POINTS, name)) is not None:
        register_contextual_method(found)
    if name not in CONTEXTUAL_METHODS:
        raise ValueError(f"unknown contextual method {name!r}; choose one of {', '.join(CONTEXTUAL_METHODS)}")
    return CONTEXTUAL_METHODS[name]


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
            if len(self.predictors):
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
        try:
            contextual_method(method)
        except ValueError as error:
            raise ValueError(f"{folder / CONFIG}: {error}") from None
        top_k, ranks, thresholds = info.pop("top_k", []), info.pop("ranks", {}), info.pop("thresholds", {})
        predictors = nn.ModuleDict()
        if ranks:
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
    method = contextual_method(plan.method)
    layers = decoder_layers(model)
    step = Forward(model.config.model_type)
    swapped: list[tuple[nn.Module, str]] = []

    def swap(parent: nn.Module, path: str, module: nn.Module) -> None:
        owner_path, _, name = path.rpartition(".")
        owner = parent.get_submodule(owner_path) if owner_path else parent
        swapped.append((owner, name))
        setattr(owner, name, module)  # the dense linear goes: no second copy of its weights stays alive

    for index, layer in enumerate(layers):
        method.wire(plan, step, index, layer, swap)

    def before_layer(index: int):
        def hook(module, args, kwargs):
            hidden = _hidden(args, kwargs)
            if index == 0:
                step.clear(decode=step.enabled and hidden.dim() == 3 and hidden.shape[1] == 1)
            if step.enabled:
                with torch.no_grad():
                    method.before_layer(plan, step, index, hidden, len(layers))
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
