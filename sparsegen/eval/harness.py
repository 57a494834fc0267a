"""sparsegen as an lm-evaluation-harness model, ``sparsegen``: any task lm-eval runs, scored through a KV policy.

    lm_eval --model sparsegen --model_args pretrained=smollm2,policy=h2o,budget=0.2,kv_bits=4 --tasks ...

(lm-eval finds it by itself through the start-up hook the install ships, ``lm_eval_hook.py``; ``sparsegen lm-eval``
is the same command line.) Every request streams its text through an ``EvictionCache`` in ``chunk_size`` chunks, evicting
between them, as ``ppl --stream`` does: log-likelihoods (``loglikelihood``, ``loglikelihood_rolling``: a document
of any length, each token predicted once from what the cache holds) and greedy generations (``generate_until``).
Under the full cache the log-likelihoods are the model's own. A fractional ``budget`` is a share of each request's
tokens. One request at a time.
"""

from __future__ import annotations

import logging

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from sparsegen.data import leading_bos
from sparsegen.decoding import forward
from sparsegen.generation import generate
from sparsegen.kv import EvictionCache, KVQuantization, make_policy
from sparsegen.models import load

log = logging.getLogger(__name__)


@register_model("sparsegen")
class SparsegenLM(LM):
    def __init__(self, pretrained: str = "smollm2", policy: str = "full", budget: int | float | None = None,
                 kv_bits: int | None = None, chunk_size: int = 512, device: str = "cpu", dtype: str | None = None,
                 max_gen_toks: int = 256, **unused):
        super().__init__()
        if unused.keys() - {"batch_size", "max_batch_size"}:  # lm-eval passes these to every model
            raise ValueError(f"unknown model_args for sparsegen: {', '.join(sorted(unused))}; it takes pretrained, "
                             "policy, budget, kv_bits, chunk_size, device, dtype, max_gen_toks")
        self.policy, self.budget, self.chunk_size, self.max_gen_toks = policy, budget, int(chunk_size), max_gen_toks
        self.kv_bits = None if kv_bits in (None, "") else KVQuantization(int(kv_bits))
        self._policy(1000)  # a bad policy or budget fails here, not after the model loads
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

    def _policy(self, tokens: int):
        return make_policy(self.policy, None if self.policy == "full" else self.budget, input_length=tokens)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def score(self, ids: list[int], start: int) -> tuple[float, bool]:
        """Sum of log p(ids[i] | what the cache holds of ids[:i]) over i >= ``start``, and whether every one of
        those tokens is the greedy choice."""
        device = next(self.model.parameters()).device
        tokens = torch.tensor([ids], device=device)
        cache = EvictionCache(self.model, self._policy(len(ids)), chunk_size=self.chunk_size, kv_bits=self.kv_bits,
                              expected_length=len(ids))
        total, greedy = 0.0, True
        for begin in range(0, len(ids) - 1, self.chunk_size):
            end = min(begin + self.chunk_size, len(ids) - 1)
            logits = forward(self.model, cache, tokens[:, begin:end], torch.arange(begin, end, device=device)[None])
            first = max(begin, start - 1)
            if first >= end:
                continue
            logprobs = logits[0, first - begin:].float().log_softmax(-1)
            target = tokens[0, first + 1:end + 1]
            total += float(logprobs.gather(-1, target[:, None]).sum())
            greedy = greedy and bool((logprobs.argmax(-1) == target).all())
        return total, greedy

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        for request in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())  # a context's trailing spaces go with the continuation
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            context_ids = self._encode(context) if context else [self.prefix]
            whole = self._encode(context + continuation) if context else [self.prefix] + self._encode(continuation)
            results.append(self.score(whole, len(context_ids)))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [self.score([self.prefix] + self._encode(request.args[0]), 1)[0]
                for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for request in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            text = generate(self.model, self.tokenizer, context, self.policy,
                            None if self.policy == "full" else self.budget,
                            max_new_tokens=int(options.get("max_gen_toks", self.max_gen_toks)),
                            temperature=float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0,
                            chunk_size=self.chunk_size, kv_bits=self.kv_bits, progress=False).texts[0]
            cut = min([text.find(stop) for stop in until if stop and stop in text], default=len(text))
            results.append(text[:cut])
        return results


def main(argv: list[str]) -> None:
    """lm-eval's own command line, with ``sparsegen`` registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
