"""Pass-key retrieval: a random 5-digit key hidden at a given depth of a haystack of real text."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from sparsegen.data import leading_bos
from sparsegen.generation import generate_tokens
from sparsegen.kv import Policy

INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def build_prompt(tokenizer, filler: np.ndarray, length: int, depth: float, key: int) -> tuple[list[int], int]:
    """Token ids of a ``length``-token prompt with the key at ``depth`` (0-1) of the haystack; also the
    index of the needle's first token."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bos = [] if leading_bos(tokenizer) is None else [tokenizer.bos_token_id]
    head, needle, tail = bos + encode(INTRO), encode(NEEDLE.format(key=key)), encode(QUESTION)
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
                     make: Callable[[], Policy], trials: int = 5, seed: int = 0, chunk_size: int = 512,
                     positions: str | None = None, progress: bool = True) -> dict:
    """Accuracy per (length, depth): greedy answers that contain the key, over ``trials`` keys and haystacks."""
    device = next(model.parameters()).device
    rng = np.random.default_rng(seed)
    cells = []
    for length in tqdm(lengths, desc="passkey", disable=not progress, leave=False):
        for depth in depths:
            keys = rng.integers(10000, 100000, size=trials)
            offsets = rng.integers(0, max(1, len(filler) - length), size=trials)
            prompts = [build_prompt(tokenizer, filler[o:], length, depth, int(k))[0] for k, o in zip(keys, offsets)]
            ids = torch.tensor(prompts, device=device)
            new, counts, stats, *_ = generate_tokens(model, ids, torch.ones_like(ids), make(), positions,
                                                     max_new_tokens=8, chunk_size=chunk_size)
            answers = tokenizer.batch_decode(new, skip_special_tokens=True)
            found = [re.search(r"\d{5}", a) for a in answers]
            correct = [bool(m) and int(m.group()) == int(k) for m, k in zip(found, keys)]
            cells.append({"length": length, "depth": depth, "accuracy": float(np.mean(correct)),
                          "answers": answers, "keys": keys.tolist(), "kv_tokens_peak": stats["kv_tokens_peak"]})
    return {"lengths": lengths, "depths": depths, "trials": trials, "cells": cells,
            "accuracy": float(np.mean([c["accuracy"] for c in cells]))}
