"""Pass-key retrieval: a random 5-digit key hidden at a given depth of a haystack of real text."""

from __future__ import annotations

import re

import numpy as np
import torch
from tqdm.auto import tqdm

from sparsegen.data import leading_bos
from sparsegen.engine.generate import generate_tokens
from sparsegen.eval.protocols import check_protocol, protocol_feed
from sparsegen.kv import PolicySpec

INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ASK, ANSWER = "\n\nWhat is the pass key?", "The pass key is"  # the question as a chat turn, and the reply's start
_HOLE = "\u2063haystack\u2063"


def chat_frame(tokenizer) -> tuple[str, str]:
    """The text an instruct model's chat template puts before and after one user message (with its own system
    prompt, if the template has a default one), ending where the assistant's reply begins."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _HOLE}], tokenize=False,
                                             add_generation_prompt=True)
    before, hole, after = rendered.partition(_HOLE)
    if not hole:
        raise ValueError("the tokenizer's chat template does not keep the user message verbatim; use --no-chat")
    return before, after


def describe_prompt(tokenizer, chat: bool) -> str:
    """The prompt as a template, for reports: the haystack as {haystack}, the needle at its depth as {needle}."""
    if not chat:
        return INTRO + "{haystack}" + NEEDLE + "{haystack}" + QUESTION
    before, after = chat_frame(tokenizer)
    return before + INTRO + "{haystack}" + NEEDLE + "{haystack}" + ASK + after + ANSWER


def _head_and_question(tokenizer, chat: bool) -> tuple[list[int], list[int]]:
    """The tokens before the haystack and the question's (what follows it)."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if chat:
        before, after = chat_frame(tokenizer)
        return encode(before + INTRO), encode(ASK + after + ANSWER)
    bos = [] if leading_bos(tokenizer) is None else [tokenizer.bos_token_id]
    return bos + encode(INTRO), encode(QUESTION)


def build_prompt(tokenizer, filler: np.ndarray, length: int, depth: float, key: int,
                 chat: bool = False) -> tuple[list[int], int]:
    """Token ids of a ``length``-token prompt with the key at ``depth`` (0-1) of the haystack; also the
    index of the needle's first token. ``chat``: the task is a user message in the model's chat template, and
    the assistant's reply starts with "The pass key is"."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head, tail = _head_and_question(tokenizer, chat)
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    room = length - len(head) - len(needle) - len(tail)
    if room < 0:
        raise ValueError(f"a {length}-token prompt cannot hold the pass-key text ({length - room} tokens)")
    if len(filler) < room:
        raise ValueError(f"the haystack text has {len(filler)} tokens; {room} are needed")
    hay = filler[:room].tolist()
    cut = round(depth * room)
    return head + hay[:cut] + needle + hay[cut:] + tail, len(head) + cut


@torch.inference_mode()
def passkey_accuracy(model, tokenizer, filler: np.ndarray, lengths: list[int], depths: list[float],
                     policy: PolicySpec, trials: int = 5, seed: int = 0, chunk_size: int = 512,
                     progress: bool = True, chat: bool = False, protocol: str = "stream") -> dict:
    """Accuracy per (length, depth): greedy answers that contain the key, over ``trials`` keys and haystacks, the
    cache under ``policy`` (a fractional budget is of what the protocol compresses); ``chat``: asked in the model's
    chat template, see ``build_prompt``. ``protocol``: how the prompt is fed, one of ``protocols.PROTOCOLS``
    (``protocol_feed`` says how each differs)."""
    check_protocol(protocol)
    question = len(_head_and_question(tokenizer, chat)[1])
    device = next(model.parameters()).device
    rng = np.random.default_rng(seed)
    cells = []
    for length in tqdm(lengths, desc="passkey", disable=not progress, leave=False):
        for depth in depths:
            keys = rng.integers(10000, 100000, size=trials)
            offsets = rng.integers(0, max(1, len(filler) - length), size=trials)
            prompts = [build_prompt(tokenizer, filler[o:], length, depth, int(k), chat)[0]
                       for k, o in zip(keys, offsets)]
            ids = torch.tensor(prompts, device=device)
            new, counts, stats, *_ = generate_tokens(model, ids, torch.ones_like(ids), policy, max_new_tokens=8,
                                                     chunk_size=chunk_size,
                                                     **protocol_feed(protocol, length, length - question))
            answers = tokenizer.batch_decode(new, skip_special_tokens=True)
            found = [re.search(r"\d{5}", a) for a in answers]
            correct = [bool(m) and int(m.group()) == int(k) for m, k in zip(found, keys)]
            cells.append({"length": length, "depth": depth, "accuracy": float(np.mean(correct)),
                          "answers": answers, "keys": keys.tolist(), "kv_tokens_peak": stats["kv_tokens_peak"]})
    return {"lengths": lengths, "depths": depths, "trials": trials, "cells": cells,
            "accuracy": float(np.mean([c["accuracy"] for c in cells]))}
