"""sparsegen as an lm-evaluation-harness model, ``sparsegen``: any task lm-eval runs, scored through a KV policy.

    lm_eval --model sparsegen --model_args pretrained=smollm2,policy=h2o,budget=0.2,kv_bits=4 --tasks ...

(lm-eval finds it by itself through the start-up hook the install ships, ``lm_eval_hook.py``; ``sparsegen lm-eval``
is the same command line.) Every request streams its text through an ``EvictionCache`` in ``chunk_size`` chunks,
evicting between them, as ``ppl --stream`` does: log-likelihoods (``loglikelihood``, ``loglikelihood_rolling``: a
document of any length, each token predicted once from what the cache holds) and greedy generations
(``generate_until``).
Under the full cache the log-likelihoods are the model's own. A fractional ``budget`` is a share of each request's
tokens.

``batch_size`` requests run together, longest first. Log-likelihoods are the same at any batch size: a batch's rows
are padded on the right, so every row's chunks (and evictions) fall where they fall alone, and a row's padding
comes after every token it scores; under a fractional budget only requests of one length share a batch. A batch of
generations is padded on the left, as ``generate`` pads: under eviction a shorter prompt's chunks then end where
the longest one's do, so its answer can differ from the one it gets alone.
"""

from __future__ import annotations

import logging

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from sparsegen.data import leading_bos
from sparsegen.engine.generate import generate
from sparsegen.engine.step import forward
from sparsegen.kv import PolicySpec
from sparsegen.models import load

log = logging.getLogger(__name__)


@register_model("sparsegen")
class SparsegenLM(LM):
    def __init__(self, pretrained: str = "smollm2", policy: str = "full", budget: int | float | None = None,
                 kv_bits: int | None = None, chunk_size: int = 512, device: str = "cpu", dtype: str | None = None,
                 max_gen_toks: int = 256, batch_size: int | str = 1, **unused):
        super().__init__()
        if unused.keys() - {"max_batch_size"}:  # lm-eval passes it to every model
            raise ValueError(f"unknown model_args for sparsegen: {', '.join(sorted(unused))}; it takes pretrained, "
                             "policy, budget, kv_bits, chunk_size, device, dtype, max_gen_toks, batch_size")
        # (a bad policy, budget or bit width fails here, not after the model loads)
        self.policy = PolicySpec.sharing(policy, budget, kv_bits=None if kv_bits in (None, "") else int(kv_bits))
        self.chunk_size, self.max_gen_toks = int(chunk_size), max_gen_toks
        self.batch_size = _batch_size(batch_size)
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval passes cuda:0 when --device is not given; its own hf model then runs on the CPU, and so do we
            log.warning("lm-eval asked for %s (its default without --device) but torch sees no CUDA GPU: running on "
                        "the CPU; pass --device cpu to choose it", device)
            device = "cpu"
        self.model, self.tokenizer = load(str(pretrained), device=device, dtype=dtype)
        if self.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer: lm-eval needs one")
        bos = leading_bos(self.tokenizer)
        self.prefix = bos if bos is not None else (self.tokenizer.bos_token_id or self.tokenizer.eos_token_id)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Request indices in batches of ``batch_size``, longest first; under a fractional budget (its size depends
        on the length) a batch holds requests of one length."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        one_length = isinstance(self.policy.budget, float)
        batches: list[list[int]] = []
        for index in order:
            if batches and len(batches[-1]) < self.batch_size and (
                    not one_length or lengths[batches[-1][0]] == lengths[index]):
                batches[-1].append(index)
            else:
                batches.append([index])
        return batches

    @torch.inference_mode()
    def score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each ``(ids, start)``: the sum of log p(ids[i] | what the cache holds of ids[:i]) over i >= ``start``,
        and whether every one of those tokens is the greedy choice. The rows run as one batch, padded on the right."""
        device = next(self.model.parameters()).device
        lengths = torch.tensor([len(ids) for ids, _ in rows], device=device)
        starts = torch.tensor([start for _, start in rows], device=device)
        length = int(lengths.max())
        tokens = torch.tensor([ids + [self.prefix] * (length - len(ids)) for ids, _ in rows], device=device)
        cache = self.policy.cache(self.model, length, chunk_size=self.chunk_size, expected_length=length)
        totals = torch.zeros(len(rows), dtype=torch.float64, device=device)
        greedy = torch.ones(len(rows), dtype=torch.bool, device=device)
        for begin in range(0, length - 1, self.chunk_size):
            end = min(begin + self.chunk_size, length - 1)
            index = torch.arange(begin, end, device=device)
            scored = (index >= starts[:, None] - 1) & (index < lengths[:, None] - 1)  # [B, T]: predicts a token
            wanted = scored.any(0).nonzero()[:, 0]
            positions = index[None].expand(len(rows), -1)
            if not len(wanted):
                forward(self.model, cache, tokens[:, begin:end], positions, last=True)
                continue
            logprobs = forward(self.model, cache, tokens[:, begin:end], positions, keep=wanted).float().log_softmax(-1)
            target, scored = tokens[:, begin + 1:end + 1][:, wanted], scored[:, wanted]
            picked = logprobs.gather(-1, target[..., None])[..., 0]
            totals += torch.where(scored, picked, 0).sum(-1, dtype=torch.float64)
            greedy &= ((logprobs.argmax(-1) == target) | ~scored).all(-1)
        return list(zip(totals.tolist(), greedy.tolist()))

    def _scores(self, rows: list[tuple[list[int], int]], desc: str, disable: bool) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        with tqdm(total=len(rows), desc=desc, disable=disable) as bar:
            for batch in self._batches([len(ids) for ids, _ in rows]):
                for index, result in zip(batch, self.score([rows[i] for i in batch])):
                    results[index] = result
                bar.update(len(batch))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows = []
        for request in requests:
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())  # a context's trailing spaces go with the continuation
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            context_ids = self._encode(context) if context else [self.prefix]
            whole = self._encode(context + continuation) if context else [self.prefix] + self._encode(continuation)
            rows.append((whole, len(context_ids)))
        return self._scores(rows, "loglikelihood", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows = [([self.prefix] + self._encode(request.args[0]), 1) for request in requests]
        return [total for total, _ in self._scores(rows, "loglikelihood_rolling", disable_tqdm)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with ``do_sample``) answers cut at the first stop string; requests with the same
        options run as one batch."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        results: list[str | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:
            for indices in groups.values():
                options = requests[indices[0]].args[1]
                until = options.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                contexts = [requests[i].args[0] for i in indices]
                lengths = [len(self._encode(context)) for context in contexts]
                for batch in self._batches(lengths):
                    texts = generate(self.model, self.tokenizer, [contexts[i] for i in batch], self.policy,
                                     max_new_tokens=int(options.get("max_gen_toks", self.max_gen_toks)),
                                     temperature=float(options.get("temperature", 0.0)) if options.get("do_sample")
                                     else 0.0, chunk_size=self.chunk_size, progress=False).texts
                    for i, text in zip(batch, texts):
                        cut = min([text.find(stop) for stop in until if stop and stop in text], default=len(text))
                        results[indices[i]] = text[:cut]
                    bar.update(len(batch))
        return results


def _batch_size(value: int | str) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size={value!r}: sparsegen takes a number of requests a batch (not 'auto'), "
                         "e.g. --batch_size 8") from None
    if size < 1:
        raise ValueError(f"batch_size={size}: give at least 1")
    return size


def main(argv: list[str]) -> None:
    """lm-eval's own command line, with ``sparsegen`` registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
