"""Deja Vu: per layer, a low-rank classifier reads the residual stream one layer ahead and guesses which MLP
neurons (and heads) the next layer needs; the model then computes only the top-K it names.

Labels: a neuron is needed when its activation is nonzero (ReLU-family models: the native sparsity) or, for
smooth activations, when it is among the fewest units that carry ``label_mass`` of the token's |activation|;
a head is needed when it is among those carrying ``label_mass`` of the head-output norm. Training uses
class-balanced BCE (each unit's positives weighted by its negative/positive ratio). Windows are split
train / validation / test: K is chosen on validation, recall and precision are reported on test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from sparsegen.contextual.collect import capture
from sparsegen.contextual.layers import ColumnSparseLinear, RowSparseLinear
from sparsegen.contextual.runtime import (
    Contextual,
    ContextualMethod,
    Forward,
    LowRankPredictor,
    Swap,
    check_heads,
    model_info,
    predictor_name,
    register_contextual_method,
)
from sparsegen.contextual.stats import needed_fraction
from sparsegen.models.anatomy import mlp_layout, neuron_count
from sparsegen.models.families import family

RELU_FAMILY = ("relu", "relu2", "relu6")


@dataclass
class DejaVuConfig:
    sparsity: float | None = None  # fraction of neurons skipped: K = (1 - sparsity) * neurons
    top_k: int | None = None  # neurons kept per token
    recall: float | None = None  # per layer, the smallest K reaching this recall on validation windows
    heads: float = 0.0  # fraction of heads skipped (0: no head predictors)
    rank: int | None = None  # default: the predictor costs <= 5% of the MLP's multiply-adds
    label_mass: float = 0.9  # smooth activations: needed units carry this much of the mass
    epochs: int = 20
    lr: float = 3e-3
    batch_tokens: int = 1024
    seed: int = 0

    def __post_init__(self):
        if sum(x is not None for x in (self.sparsity, self.top_k, self.recall)) != 1:
            raise ValueError("give exactly one of --sparsity (e.g. 0.9), --top-k (neurons kept) and --recall "
                             "(e.g. 0.95: per layer, the smallest K that reaches it)")
        if self.sparsity is not None and not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top-k must be >= 1, got {self.top_k}")
        if self.recall is not None and not 0 < self.recall <= 1:
            raise ValueError(f"recall must be in (0, 1], got {self.recall}")
        if not 0 <= self.heads < 1:
            raise ValueError(f"heads (the fraction skipped) must be in [0, 1), got {self.heads}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")


def default_rank(hidden: int, neurons: int, mlp_matrices: int) -> int:
    """The rank at which ``hidden -> rank -> neurons`` costs 5% of an MLP of ``mlp_matrices`` hidden x neurons."""
    return max(1, math.floor(0.05 * mlp_matrices * hidden * neurons / (hidden + neurons)))


def needed(values: torch.Tensor, relu: bool, mass: float) -> torch.Tensor:
    """Boolean labels ``[N, units]``: the units a token needs."""
    if relu:
        return values != 0
    count = (needed_fraction(values, mass) * values.shape[-1]).round().long()  # units needed per token
    ranks = values.argsort(-1, descending=True).argsort(-1)
    return ranks < count[:, None]


def recall_curve(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean recall over tokens (with at least one positive) of the top-K by score, for K = 1..units."""
    hits = labels.gather(-1, scores.argsort(-1, descending=True)).float()
    positives = hits.sum(-1)
    has = positives > 0
    if not has.any():
        return torch.ones(labels.shape[-1])
    return (hits[has].cumsum(-1) / positives[has, None]).mean(0)


def measure(scores: torch.Tensor, labels: torch.Tensor, values: torch.Tensor, k: int) -> dict[str, float]:
    """Recall, precision and captured |activation| mass of the top-``k`` by score."""
    chosen = torch.zeros_like(labels).scatter_(-1, scores.topk(k, -1).indices, True)
    hits = (chosen & labels).sum(-1).float()
    positives = labels.sum(-1).float()
    has = positives > 0
    mass = (values * chosen).sum(-1) / values.sum(-1).clamp(min=1e-30)
    return {"recall": (hits[has] / positives[has]).mean().item() if has.any() else 1.0,
            "precision": (hits / k).mean().item(), "mass_recall": mass.mean().item(),
            "label_density": labels.float().mean().item()}


def train_predictor(x: torch.Tensor, labels: torch.Tensor, rank: int, config: DejaVuConfig,
                    progress: tqdm | None = None) -> LowRankPredictor:
    """Fit ``x [N, hidden] -> labels [N, units]`` with class-balanced BCE."""
    generator = torch.Generator().manual_seed(config.seed)
    with torch.random.fork_rng(devices=[]):  # seeded initialisation, the caller's random state untouched
        torch.manual_seed(config.seed)
        predictor = LowRankPredictor(x.shape[1], rank, labels.shape[1])
    positives = labels.float().sum(0)
    pos_weight = ((len(labels) - positives + 1) / (positives + 1)).clamp(max=1e3)
    optimizer = torch.optim.Adam(predictor.parameters(), lr=config.lr)
    steps = config.epochs * math.ceil(len(x) / config.batch_tokens)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    with torch.enable_grad():
        for _ in range(config.epochs):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x), config.batch_tokens):
                batch = order[start:start + config.batch_tokens]
                loss = F.binary_cross_entropy_with_logits(predictor(x[batch]), labels[batch].float(),
                                                          pos_weight=pos_weight)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
            if progress is not None:
                progress.set_postfix(loss=f"{loss.item():.4f}")
    return predictor.eval()


def _splits(windows: int, seqlen: int) -> tuple[slice, slice, slice]:
    """Token ranges of whole windows: train, validation (choosing K), test (reported)."""
    if windows < 3:
        raise ValueError(f"Deja Vu needs at least 3 calibration windows (train, validation, test); got {windows}")
    held = max(1, round(0.15 * windows))
    train_end, val_end = (windows - 2 * held) * seqlen, (windows - held) * seqlen
    return slice(0, train_end), slice(train_end, val_end), slice(val_end, None)


def fit_dejavu(model: nn.Module, ids: torch.Tensor, config: DejaVuConfig, batch_size: int = 8,
               progress: bool = True) -> Contextual:
    model_type = model.config.model_type
    if config.heads:
        check_heads(model)
    data = capture(model, ids, predictors=True, magnitudes=False, batch_size=batch_size, progress=progress)
    train, val, test = _splits(*ids.shape)
    relu = str(getattr(model.config, "hidden_act", getattr(model.config, "activation_function", ""))) in RELU_FAMILY
    hidden = model.config.get_text_config().hidden_size
    mlp_matrices = family(model_type).mlp_matrices
    predictors, top_k, layers_report = nn.ModuleDict(), [], []
    bar = tqdm(total=len(data.neurons) * (2 if config.heads else 1), desc="predictors", disable=not progress)
    for index in range(len(data.neurons)):
        source = data.inputs[max(index - 1, 0)]  # lookahead: layer l-1's input predicts layer l
        report, chosen = {"layer": index}, {}
        kinds = [("mlp", data.neurons[index])] + ([("heads", data.heads[index])] if config.heads else [])
        for kind, values in kinds:
            units = values.shape[1]
            labels = needed(values, relu and kind == "mlp", config.label_mass)
            if kind == "mlp":
                rank = config.rank or default_rank(hidden, units, mlp_matrices)
            else:
                rank = max(1, min(units, config.rank or units))
            predictor = train_predictor(source[train], labels[train], rank, config, bar)
            with torch.no_grad():
                val_scores, test_scores = predictor(source[val]), predictor(source[test])
            if kind == "heads":
                k = units - round(config.heads * units)
            elif config.recall is not None:
                reached = (recall_curve(val_scores, labels[val]) >= config.recall - 1e-6).nonzero()
                k = int(reached[0]) + 1 if len(reached) else units
            elif config.top_k is not None:
                if config.top_k > units:
                    raise ValueError(f"top-k {config.top_k} exceeds the {units} neurons of layer {index}")
                k = config.top_k
            else:
                k = max(1, units - round(config.sparsity * units))
            predictors[predictor_name(index, kind)] = predictor
            chosen[kind] = k
            report[kind] = {"units": units, "k": k, "sparsity": 1 - k / units, "rank": rank,
                            **measure(test_scores, labels[test], values[test], k)}
            bar.update()
        top_k.append(chosen)
        layers_report.append(report)
    bar.close()
    info = {**model_info(model), "labels": "nonzero" if relu else f"units carrying {config.label_mass:.0%} of mass",
            "calibration_tokens": ids.numel(), "selection": {k: v for k, v in (("sparsity", config.sparsity),
                                                                               ("top_k", config.top_k),
                                                                               ("recall", config.recall))
                                                             if v is not None},
            "heads_skipped": config.heads, "report": layers_report}
    return Contextual("dejavu", info, top_k, predictors)


class _Predicted:
    """The units a predictor chose for one layer (a ``layers.Selection``)."""

    def __init__(self, forward: Forward, key: tuple[int, str]):
        self.forward, self.key = forward, key

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.forward.enabled:
            return None
        mask = self.forward.masks.get(self.key)
        if mask is None:
            top = self.forward.top[self.key]
            mask = torch.zeros(*top.shape[:-1], self.forward.sizes[self.key], dtype=torch.bool, device=top.device)
            mask = self.forward.masks[self.key] = mask.scatter_(-1, top, True)
        return mask

    def union(self) -> torch.Tensor | None:
        return self.forward.units.get(self.key)


@register_contextual_method
class DejaVu(ContextualMethod):
    """Low-rank lookahead predictors choose each token's top-K MLP neurons (and heads)."""

    name = "dejavu"
    options = ("sparsity", "top_k", "recall", "heads", "rank", "epochs")
    calibration_windows = 128

    def fit(self, model, ids, batch_size=8, seed=0, progress=True, **options) -> Contextual:
        return fit_dejavu(model, ids, DejaVuConfig(seed=seed, **options), batch_size, progress)

    def summary(self, plan: Contextual) -> list[str]:
        lines = [f"deja vu on {plan.info['calibration_tokens']:,} tokens ({plan.info['labels']}); per layer on "
                 f"held-out windows:",
                 f"{'layer':>5}{'kind':>6}{'units':>7}{'K':>6}{'sparsity':>10}{'rank':>6}{'recall':>8}"
                 f"{'precision':>11}{'mass':>7}"]
        for layer in plan.info["report"]:
            for kind in ("mlp", "heads"):
                if kind in layer:
                    r = layer[kind]
                    lines.append(f"{layer['layer']:>5}{kind:>6}{r['units']:>7}{r['k']:>6}{r['sparsity']:>10.3f}"
                                 f"{r['rank']:>6}{r['recall']:>8.3f}{r['precision']:>11.3f}{r['mass_recall']:>7.3f}")
        return lines

    def wire(self, plan: Contextual, forward: Forward, index: int, layer: nn.Module, swap: Swap) -> None:
        model_type = forward.model_type
        producers, consumer = mlp_layout(model_type)
        neurons, size = _Predicted(forward, (index, "mlp")), neuron_count(layer, model_type)
        forward.sizes[(index, "mlp")] = size
        for path in producers:
            linear = layer.get_submodule(path)
            swap(layer, path, RowSparseLinear(linear, neurons, forward.decoding, copies=linear.out_features // size))
        swap(layer, consumer, ColumnSparseLinear(layer.get_submodule(consumer), neurons, forward.decoding))
        if predictor_name(index, "heads") in plan.predictors:
            heads, attention = _Predicted(forward, (index, "heads")), layer.self_attn
            forward.sizes[(index, "heads")] = attention.q_proj.out_features // attention.head_dim
            swap(layer, "self_attn.q_proj", RowSparseLinear(attention.q_proj, heads, forward.decoding,
                                                            attention.head_dim))
            swap(layer, "self_attn.o_proj", ColumnSparseLinear(attention.o_proj, heads, forward.decoding,
                                                               attention.head_dim))

    def before_layer(self, plan: Contextual, forward: Forward, index: int, hidden: torch.Tensor, layers: int) -> None:
        if index == 0:
            self._predict(plan, forward, 0, hidden)
        if index + 1 < layers:
            self._predict(plan, forward, index + 1, hidden)  # lookahead: layer l's input chooses layer l+1's units

    @staticmethod
    def _predict(plan: Contextual, forward: Forward, index: int, hidden: torch.Tensor) -> None:
        for kind in ("mlp", "heads"):
            name = predictor_name(index, kind)
            if name in plan.predictors:
                top = plan.predictors[name](hidden).topk(plan.top_k[index][kind], dim=-1).indices
                forward.top[(index, kind)] = top
                if forward.decode:
                    forward.units[(index, kind)] = top.flatten().unique()  # sorted
