"""RULER's synthetic long-context tasks (Hsieh et al., 2024), generated here from any haystack text, and scored as
the paper scores them: for each sample, the share of its reference strings found in the answer (case-insensitive),
averaged per task.

The eleven synthetic tasks of RULER's default suite: needle-in-a-haystack with one needle in repeated noise or in a
book with a number or a UUID for a value (``niah_single_1..3``), several keys in a book or in a haystack made of
other needles (``niah_multikey_1..3``), several values for one key (``niah_multivalue``), several keys asked at once
(``niah_multiquery``), variable tracking through a chain of assignments (``vt``), and the most common or most
frequent words of a list (``cwe``, ``fwe``). RULER's two QA tasks need SQuAD and HotpotQA, which this machine
cannot fetch, so they are not here. Prompts use RULER's wording, fill a given token length, place the (queried)
needle at a given depth, and are seeded: the same arguments give the same prompts.

Five protocols compress the cache: ``stream`` feeds the whole prompt in chunks and evicts as it goes (what a
streaming deployment does); ``context`` encodes the context in one pass, compresses it once to the budget with the
policy's scores, then feeds the question and decodes, eviction continuing (the budget caps memory throughout);
``context-once`` is kvpress's exactly: the same compression, and nothing evicted after it (the cache grows by the
question and the answer); ``query-aware`` encodes the whole prompt, question included, in one pass and compresses it
once, so the policy's scores have seen the question (SnapKV's own setting: its observation window is the prompt's
end), then decodes with the budget holding; ``query-aware-once`` is kvpress's ``compress_questions`` exactly (the same
compression, nothing evicted after it). A fractional budget is a share of the
context under every protocol, so each keeps the same number of tokens.
"""

from __future__ import annotations

import re
import string
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from sparsegen.data import leading_bos
from sparsegen.engine.generate import generate_tokens
from sparsegen.engine.speculative import Speculation, speculative_tokens
from sparsegen.eval.passkey import chat_frame
from sparsegen.eval.protocols import check_protocol, protocol_feed
from sparsegen.kv import PolicySpec

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the {kind} afterwards.\n", "\nWhat are all the special magic {kind} for {query} mentioned in the "
        "provided text?", " The special magic {kind} for {query} mentioned in the provided text are")
NEEDLE = " One of the special magic {kind} for {key} is: {value}. "
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
      "\nQuestion: Find all variables that are assigned the value {value} in the text above.",
      " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are assigned "
      "the value {value}, they are: ")
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n", "\nQuestion: What are the 10 most common words in the above list?",
       " Answer: The top 10 words that appear most often in the list are:")
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. ", "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What "
       "are the three most frequently appeared words in the above coded text?",
       " Answer: According to the coded text above, the three most frequently appeared words are:")


@dataclass(frozen=True)
class Niah:
    """A needle-in-a-haystack task: its haystack, the kinds of its keys and values, and how many needles."""
    haystack: str  # noise, essay (the haystack text) or needle (other needles)
    key: str = "words"  # words or uuids
    value: str = "numbers"  # numbers or uuids
    keys: int = 1  # needles with different keys
    values: int = 1  # needles with the queried key
    queries: int = 1  # keys asked for


TASKS: dict[str, Niah | str] = {
    "niah_single_1": Niah("noise"),
    "niah_single_2": Niah("essay"),
    "niah_single_3": Niah("essay", value="uuids"),
    "niah_multikey_1": Niah("essay", keys=4),
    "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", key="uuids", value="uuids"),
    "niah_multivalue": Niah("essay", values=4),
    "niah_multiquery": Niah("essay", keys=4, queries=4),
    "vt": "vt",
    "cwe": "cwe",
    "fwe": "fwe",
}
NEW_TOKENS = {"vt": 30, "cwe": 120, "fwe": 50}  # RULER's answer lengths; 128 for the needle tasks


@dataclass
class Sample:
    task: str
    ids: list[int]
    context_tokens: int  # where the question starts (the ``context`` protocol compresses what comes before)
    answers: list[str]
    depth: float | None = None  # of the queried needle in the haystack, for the needle tasks
    max_new_tokens: int = 128


@dataclass
class Haystack:
    """The text a task's filler comes from, tokenized once, and a vocabulary of its plain words (keys, list words)."""
    tokenizer: object
    text: str
    tokens: np.ndarray = field(init=False)
    words: list[str] = field(init=False)
    _boundaries: np.ndarray = field(init=False)

    def __post_init__(self):
        self.tokens = np.array(self.encode(self.text))
        self.words = sorted({w for w in re.findall(r"\b[a-z]{4,10}\b", self.text)})
        if len(self.words) < 200:
            raise ValueError(f"the haystack text has {len(self.words)} distinct plain words; RULER's keys and word "
                             "lists need at least 200: give a longer text (--haystack)")
        ends = {i for token, i in self.tokenizer.get_vocab().items() if token.rstrip().endswith(".")}
        self._boundaries = np.array([t in ends for t in self.tokens.tolist()])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def essay(self, start: int, count: int) -> tuple[list[int], np.ndarray]:
        """``count`` tokens of the text from ``start`` (wrapping), and where its sentences end."""
        reps = -(-(start + count) // len(self.tokens))
        take = np.tile(self.tokens, reps)[start:start + count]
        return take.tolist(), np.tile(self._boundaries, reps)[start:start + count]


def _frame(tokenizer, chat: bool) -> tuple[str, str, list[int]]:
    if chat:
        before, after = chat_frame(tokenizer)
        return before, after, []
    bos = leading_bos(tokenizer)
    return "", "", [] if bos is None else [bos]


def _key(rng: np.random.Generator, hay: Haystack, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    first, second = rng.choice(len(hay.words), 2, replace=False)
    return f"{hay.words[first]}-{hay.words[second]}"


def _value(rng: np.random.Generator, kind: str) -> str:
    return _key(rng, None, "uuids") if kind == "uuids" else str(int(rng.integers(1_000_000, 10_000_000)))


def _insert(filler: list[int], boundaries: np.ndarray, pieces: list[tuple[float, list[int]]]) -> list[int]:
    """``filler`` with each piece inserted at its depth (0-1), moved to the nearest sentence end (or either end)."""
    ends = np.concatenate([[0], np.flatnonzero(boundaries) + 1, [len(filler)]])
    out, last = [], 0
    for depth, piece in sorted(pieces, key=lambda p: p[0]):
        allowed = ends[ends >= last]
        cut = int(allowed[np.abs(allowed - depth * len(filler)).argmin()])
        out += filler[last:cut] + piece
        last = cut
    return out + filler[last:]


def _assemble(hay: Haystack, chat: bool, head: str, tail: str, prefix: str, length: int,
              body: Callable[[int], list[int]]) -> tuple[list[int], int]:
    """A prompt of at most ``length`` tokens: head, ``body(room)`` (the context), tail and the answer's start; and
    where the question starts."""
    before, after, bos = _frame(hay.tokenizer, chat)
    head_ids, tail_ids = bos + hay.encode(before + head), hay.encode(tail + after + prefix)
    room = length - len(head_ids) - len(tail_ids)
    context = head_ids + body(room)
    return context + tail_ids, len(context)


def _niah(task: str, spec: Niah, hay: Haystack, length: int, depth: float, rng: np.random.Generator,
          chat: bool) -> Sample:
    keys = [_key(rng, hay, spec.key) for _ in range(max(spec.keys, spec.queries))]
    values = [[_value(rng, spec.value) for _ in range(spec.values)] for _ in keys]
    kind = "uuids" if spec.value == "uuids" else "numbers"
    asked = keys[:spec.queries]
    query = ", ".join(asked[:-1]) + " and " + asked[-1] if len(asked) > 1 else asked[0]
    needles = [hay.encode(NEEDLE.format(kind=kind, key=k, value=v)) for k, vs in zip(keys, values) for v in vs]
    head, tail, prefix = (part.format(kind=kind, query=query) for part in NIAH)

    def body(room: int) -> list[int]:
        room -= sum(map(len, needles))
        if room < 0:
            raise ValueError(f"a {length}-token prompt cannot hold the {task} needles and question")
        if spec.haystack == "essay":
            filler, ends = hay.essay(int(rng.integers(0, len(hay.tokens))), room)
        elif spec.haystack == "noise":
            noise = hay.encode(" " + NOISE)
            filler = (noise * (room // len(noise) + 1))[:room]
            ends = np.zeros(room, dtype=bool)
            ends[len(noise) - 1::len(noise)] = True
        else:  # other needles, with other keys, all the way
            filler, ends = [], []
            while True:
                key, value = _key(rng, hay, spec.key), _value(rng, spec.value)
                other = hay.encode(NEEDLE.format(kind=kind, key=key, value=value))
                if len(filler) + len(other) > room:
                    break
                filler += other
                ends += [False] * (len(other) - 1) + [True]
            ends = np.array(ends, dtype=bool)
        # the queried key's first needle at ``depth``; the rest anywhere
        depths = [depth] + rng.uniform(0, 1, len(needles) - 1).tolist()
        return _insert(filler, ends, list(zip(depths, needles)))

    ids, context = _assemble(hay, chat, head, tail, prefix, length, body)
    answers = [v for vs in values[:spec.queries] for v in vs]
    return Sample(task, ids, context, answers, depth)


def _variable_tracking(hay: Haystack, length: int, rng: np.random.Generator, chat: bool, hops: int = 4) -> Sample:
    names = set()
    while len(names) < hops + 1:
        names.add("".join(rng.choice(list(string.ascii_uppercase), 5)))
    names = [sorted(names)[i] for i in rng.permutation(len(names))]
    value = str(int(rng.integers(10_000, 100_000)))
    chain = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    pieces = [hay.encode(c) for c in chain]
    head, tail, prefix = (part.format(value=value, count=hops + 1) for part in VT)

    def body(room: int) -> list[int]:
        noise = hay.encode(" " + NOISE)
        room -= sum(map(len, pieces))
        filler = (noise * (room // len(noise) + 1))[:room]
        ends = np.zeros(len(filler), dtype=bool)
        ends[len(noise) - 1::len(noise)] = True
        return _insert(filler, ends, list(zip(sorted(rng.uniform(0, 1, len(pieces))), pieces)))

    ids, context = _assemble(hay, chat, head, tail, prefix, length, body)
    return Sample("vt", ids, context, names, max_new_tokens=NEW_TOKENS["vt"])


def _common_words(hay: Haystack, length: int, rng: np.random.Generator, chat: bool, common: int = 10) -> Sample:
    """A numbered list in which ten words come often (30 times, fewer in a short prompt) and the rest 3 times."""
    picked = [hay.words[i] for i in rng.permutation(len(hay.words))]
    answers, rest = picked[:common], picked[common:]

    def listing(words: list[str]) -> list[int]:
        return hay.encode("".join(f"{i + 1}. {w}\n" for i, w in enumerate(words)))

    def body(room: int) -> list[int]:
        per_entry = len(listing(picked[:50])) / 50
        entries = int(room / per_entry)
        often = min(30, max(2, entries // (2 * common)))
        rarely = min(3, often - 1)
        uncommon = max(0, (entries - often * common) // rarely) if rarely else 0
        while True:
            words = answers * often + [w for w in rest[:uncommon] for _ in range(rarely)]
            words = [words[i] for i in rng.permutation(len(words))]
            ids = listing(words)
            if len(ids) <= room or not uncommon:
                return ids
            uncommon = int(uncommon * 0.95)

    ids, context = _assemble(hay, chat, *CWE, length, body)
    return Sample("cwe", ids, context, answers, max_new_tokens=NEW_TOKENS["cwe"])


def _frequent_words(hay: Haystack, length: int, rng: np.random.Generator, chat: bool, alpha: float = 2.0) -> Sample:
    """Coded words drawn from a Zipf distribution (exponent ``alpha``): the three most frequent are the answer."""
    vocab = sorted({"".join(rng.choice(list(string.ascii_lowercase), 6)) for _ in range(1000)})
    vocab = [vocab[i] for i in rng.permutation(len(vocab))]
    answers: list[str] = []

    def body(room: int) -> list[int]:
        per_word = len(hay.encode(" " + " ".join(vocab[:100]))) / 100
        count = int(room / per_word * 0.9)
        while True:
            ranks = rng.zipf(alpha, 4 * count)
            ranks = ranks[ranks <= len(vocab)][:count] - 1
            words = [vocab[r] for r in ranks]
            top = Counter(words).most_common(4)
            ids = hay.encode(" " + " .... ".join(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)))
            if len(ids) <= room and len(top) == 4 and top[2][1] > top[3][1]:
                answers[:] = [w for w, _ in top[:3]]
                return ids
            count = int(count * 0.95) if len(ids) > room else count

    ids, context = _assemble(hay, chat, *FWE, length, body)
    return Sample("fwe", ids, context, answers, max_new_tokens=NEW_TOKENS["fwe"])


def make_samples(hay: Haystack, task: str, length: int, count: int, seed: int = 0, chat: bool = False,
                 depths: list[float] | None = None) -> list[Sample]:
    """``count`` prompts of ``task`` at most ``length`` tokens long; the needle tasks cycle through ``depths``
    (default: 0, 0.25, 0.5, 0.75, 1)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    depths = depths or [0.0, 0.25, 0.5, 0.75, 1.0]
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must be in [0, 1], got {depths}")
    rng = np.random.default_rng([seed, length, list(TASKS).index(task)])
    spec = TASKS[task]
    samples = []
    for i in range(count):
        if isinstance(spec, Niah):
            samples.append(_niah(task, spec, hay, length, depths[i % len(depths)], rng, chat))
        else:
            samples.append({"vt": _variable_tracking, "cwe": _common_words, "fwe": _frequent_words}[spec](
                hay, length, rng, chat))
    return samples


def score(answer: str, references: list[str]) -> float:
    """RULER's string match: the share of the references that appear in the answer, ignoring case."""
    answer = answer.lower()
    return sum(ref.lower() in answer for ref in references) / len(references)


@torch.inference_mode()
def evaluate(model, tokenizer, samples: list[Sample], policy: PolicySpec, protocol: str = "stream",
             chunk_size: int = 512, max_new_tokens: int | None = None, progress: bool = True,
             speculation: Callable[[int], Speculation] | None = None, compile: bool | str | None = None) -> list[dict]:
    """Greedy answers to ``samples`` (one at a time) through a cache under ``policy`` (a fractional budget is of each
    sample's context), each with its score: ``[{"task", "depth", "score", "answer", "answers", "kv_tokens_peak"}]``.
    ``speculation`` (``policy`` full, ``stream`` protocol): the same answers, drafted over a cache under
    ``speculation(context_tokens)``'s policy; each result then carries the round's ``speculation`` report.
    ``compile``: answer tokens through the compiled decode step (``DecodeStep``)."""
    check_protocol(protocol)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    results = []
    for sample in tqdm(samples, desc="ruler", unit="sample", disable=not progress, leave=False):
        ids = torch.tensor([sample.ids], device=device)
        common = dict(max_new_tokens=max_new_tokens or sample.max_new_tokens, chunk_size=chunk_size, eos_id=eos,
                      pad_id=eos if eos is not None else 0, progress=False, compile=compile)
        if speculation is None:
            new, counts, stats, *_ = generate_tokens(
                model, ids, torch.ones_like(ids), policy.resolved(sample.context_tokens),
                **protocol_feed(protocol, len(sample.ids), sample.context_tokens), **common)
        else:
            check_speculation(policy, protocol)
            new, counts, stats, *_ = speculative_tokens(model, ids, torch.ones_like(ids),
                                                        speculation(sample.context_tokens), **common)
        answer = tokenizer.decode(new[0, :int(counts[0])], skip_special_tokens=True)
        results.append({"task": sample.task, "depth": sample.depth, "score": score(answer, sample.answers),
                        "answer": answer, "answers": sample.answers, "kv_tokens_peak": stats["kv_tokens_peak"],
                        **({"speculation": stats["speculation"]} if "speculation" in stats else {})})
    return results


def check_speculation(policy: PolicySpec, protocol: str) -> None:
    """Speculative answers are the full cache's, with the prompt streamed: refuse anything else."""
    if protocol != "stream" or policy.kv_bits is not None:
        raise ValueError("speculative decoding drafts while streaming the prompt and verifies with the model's own "
                         "full cache: use --protocol stream and no --kv-bits")
    if policy.bounded:
        raise ValueError(f"speculative decoding verifies with the full cache: run --policies full, not "
                         f"{policy.name} (the draft cache takes its policy from --speculative)")


def summarize(results: list[dict]) -> dict:
    """Mean score per task, per (task, depth) for the needle tasks, and the average over tasks (RULER's)."""
    tasks = {}
    for r in results:
        tasks.setdefault(r["task"], []).append(r)
    per_task = {t: float(np.mean([r["score"] for r in rs])) for t, rs in tasks.items()}
    per_depth = {t: {str(d): float(np.mean([r["score"] for r in rs if r["depth"] == d]))
                     for d in sorted({r["depth"] for r in rs})}
                 for t, rs in tasks.items() if rs[0]["depth"] is not None}
    return {"tasks": per_task, "depths": per_depth, "average": float(np.mean(list(per_task.values())))}


def run(model, tokenizer, haystack: str, policies: dict[str, PolicySpec], lengths: list[int],
        tasks: list[str] | None = None, samples: int = 20, protocols: tuple[str, ...] = ("stream",),
        chat: bool = False, depths: list[float] | None = None, seed: int = 0, chunk_size: int = 512,
        max_new_tokens: int | None = None, progress: bool = True,
        on_row: Callable[[dict], None] | None = None, done: list[dict] | None = None,
        speculation: Callable[[int], Speculation] | None = None, compile: bool | str | None = None) -> dict:
    """RULER over ``policies`` (name -> cache settings; a fractional budget is of each prompt's context) x
    ``protocols`` x ``lengths`` x ``tasks``:
    ``{"rows": [{"policy", "budget", "protocol", "task", "length", "score", "depths", "kv_tokens_peak",
    "samples": [...]}]}``, the same prompts for every policy. ``done``: rows of an interrupted run with the same
    settings; each (policy, protocol, task, length) among them is taken as it is, not evaluated again.
    ``speculation``: see ``evaluate``; each row then has the draft's ``acceptance_rate`` and ``tokens_per_step``."""
    if speculation is not None:  # before any row runs, not when the first one it cannot run comes up
        for policy, protocol in ((policy, protocol) for policy in policies.values() for protocol in protocols):
            check_speculation(policy, protocol)
    hay = Haystack(tokenizer, haystack)
    tasks = tasks or list(TASKS)
    prompts = {(task, length): make_samples(hay, task, length, samples, seed, chat, depths)
               for length in lengths for task in tasks}
    finished = {(r["policy"], r["protocol"], r["task"], r["length"]): r for r in done or []}
    rows = []
    for name, policy in policies.items():
        for protocol in protocols:
            for (task, length), task_samples in prompts.items():
                if (name, protocol, task, length) in finished:
                    rows.append(finished[name, protocol, task, length])
                    continue
                results = evaluate(model, tokenizer, task_samples, policy, protocol, chunk_size, max_new_tokens,
                                   progress, speculation, compile)
                summary = summarize(results)
                row = {"policy": name, "budget": policy.build(task_samples[0].context_tokens).budget,
                       "protocol": protocol, "task": task, "length": length, "score": summary["tasks"][task],
                       "depths": summary["depths"].get(task),
                       "kv_tokens_peak": max(r["kv_tokens_peak"] for r in results),
                       "prompt_tokens": max(len(s.ids) for s in task_samples), "samples": results}
                if speculation is not None:
                    draft = speculation(task_samples[0].context_tokens).policy
                    reports = [r["speculation"] for r in results]
                    proposed = sum(r["proposed"] for r in reports)
                    steps = [r["tokens_per_step"] for r in reports if r["tokens_per_step"] is not None]
                    row["draft"] = {"policy": draft.name, "budget": draft.budget,
                                    "context_share": round(draft.budget / task_samples[0].context_tokens, 2),
                                    "acceptance_rate": sum(r["accepted"] for r in reports) / proposed if proposed
                                    else None, "tokens_per_step": float(np.mean(steps)) if steps else None}
                rows.append(row)
                if on_row:
                    on_row(row)
    return {"rows": rows}


def policy_label(row: dict) -> str:
    """A row's policy, with the draft cache's where its answers were drafted speculatively (its budget as a share
    of the context, which tasks of one length share)."""
    draft = row.get("draft")
    return row["policy"] if draft is None else f"{row['policy']} (draft {draft['policy']} {draft['context_share']:.0%})"


def markdown(rows: list[dict]) -> str:
    """One line per (policy, protocol, length): each task's score and RULER's average over tasks."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lines = ["| policy | budget | protocol | length | " + " | ".join(tasks) + " | average |",
             "|---|---|---|---|" + "---|" * (len(tasks) + 1)]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((policy_label(r), r["protocol"], r["length"]), {})[r["task"]] = r
    for (policy, protocol, length), by_task in groups.items():
        scores = [by_task[t]["score"] if t in by_task else None for t in tasks]
        budget = next(iter(by_task.values()))["budget"]
        cells = " | ".join("-" if s is None else f"{s:.2f}" for s in scores)
        mean = np.mean([s for s in scores if s is not None])
        lines.append(f"| {policy} | {budget if budget is not None else 'all'} | {protocol} | {length:,} | {cells} | "
                     f"{mean:.2f} |")
    return "\n".join(lines)
