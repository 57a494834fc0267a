"""sparsegen beside NVIDIA kvpress on the same RULER prompts, in one run (``make kvpress-ruler``; kvpress 0.5.5 pins
transformers < 5.3, so this runs in its own venv, ``.venv-kvpress``, where sparsegen runs too).

Both libraries see the same model weights and the same prompts (``sparsegen.eval.ruler.make_samples``): the context
prefilled in one pass and compressed once to ``budget`` of its tokens, then the question and a greedy answer. kvpress
compresses inside its press's forward hooks on a ``DynamicCache`` and decodes with the cache left as it is, so its
cache grows by the question and the answer: sparsegen's ``context-once`` protocol is exactly that
(``sparsegen-once``); its ``context`` protocol (``sparsegen``) instead holds the budget through the question and the
answer (its policy keeps evicting: a cap on memory). Scores are RULER's string match, per task; the table shows each
row's peak K/V tokens after the context beside its score (kvpress's and ``sparsegen-once``'s grow past it).
``--protocol query-aware``: the question is compressed with the context, in one pass (kvpress's
``compress_questions``; sparsegen's ``query-aware`` protocol, and ``query-aware-once`` for ``sparsegen-once``), each
press keeping as many tokens as under ``context``.

    .venv-kvpress/bin/python scripts/kvpress_ruler.py --model smollm2 --length 4096 --samples 3 \\
        --tasks niah_single_1,niah_single_2 --methods snapkv,knorm,streaming --budget 0.5 --json OUT

``--libraries sparsegen-once`` (sparsegen's rows alone) runs without kvpress, in the project's own venv.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import sparsegen
from sparsegen.data import data_dir
from sparsegen.eval import ruler
from sparsegen.kv import PolicySpec
from sparsegen.kv.policies import policy_class, policy_options

PRESSES = {"snapkv": "SnapKVPress", "knorm": "KnormPress", "streaming": "StreamingLLMPress", "tova": "TOVAPress",
           "keydiff": "KeyDiffPress", "random": "RandomPress", "lagkv": "LagKVPress",
           "pyramid-snapkv": "PyramidKVPress", "kvzip": "KVzipPress", "expected-attention": "ExpectedAttentionPress"}
# (sparsegen's `pyramid` scores by H2O's sums: no kvpress press does)
ADAPTIVE = {"ada-snapkv": "SnapKVPress"}  # kvpress's AdaKVPress over this scorer press


def make_press(kvpress, method: str, budget: float):
    """kvpress's press for a sparsegen policy name, keeping ``budget`` of what it presses."""
    if method in ADAPTIVE:
        return kvpress.AdaKVPress(getattr(kvpress, ADAPTIVE[method])(compression_ratio=1 - budget))
    return getattr(kvpress, PRESSES[method])(compression_ratio=1 - budget)


def global_layers(model) -> list[int]:
    """The layers that attend over the whole sequence (Gemma 3's sliding-window layers left out)."""
    return [i for i, layer in enumerate(model.model.layers) if not getattr(layer.self_attn, "is_sliding", False)]


@contextlib.contextmanager
def pressed(model, press):
    """``press`` on ``model``'s layers, or on its global layers alone where some slide: kvpress presses only a Gemma 3's
    global layers, but its check names the multimodal class, so on the text model (``Gemma3ForCausalLM``) it would
    press the sliding-window layers too, which sparsegen leaves to their window. This is its own hook on those
    layers, set up as its ``press(model)`` does."""
    layers = model.model.layers
    if press is None or len(global_layers(model)) == len(layers):
        with press(model) if press is not None else contextlib.nullcontext():
            yield
        return
    press.post_init_from_model(model)
    hooks = []
    for index in global_layers(model):
        layers[index].self_attn.rotary_emb = model.model.rotary_emb
        hooks.append(layers[index].self_attn.register_forward_hook(press.forward_hook, with_kwargs=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.inference_mode()
def kvpress_answer(model, tokenizer, sample: ruler.Sample, press, query_aware: bool = False) -> tuple[str, int]:
    """kvpress's protocol by hand (what its pipeline does, without its chat formatting: the prompt is RULER's as
    sparsegen built it): the context through the press, then the question and a greedy answer on the pressed cache.
    ``query_aware`` (kvpress's ``compress_questions``): the question is pressed with the context, in one pass."""
    split = len(sample.ids) if query_aware else sample.context_tokens
    context, question = torch.tensor([sample.ids[:split]]), torch.tensor([sample.ids[split:]])
    cache = DynamicCache(config=model.config)  # (sliding-window layers hold their window, as sparsegen's do)
    with pressed(model, press):
        logits = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    layer = global_layers(model)[0]
    held = cache.get_seq_length(layer)  # after the press (it grows by what is fed after)
    masked = getattr(model.model.layers[layer].self_attn, "masked_key_indices", None)
    if masked is not None:  # AdaKVPress masks what it evicts (its cache keeps every key): the mean kept per head
        held -= len(masked[0]) // cache.layers[layer].keys.shape[1]
    if question.shape[1]:
        position = torch.arange(split, len(sample.ids))[None]
        # per-layer budgets (PyramidKV) leave the global layers different lengths; transformers builds one mask for a
        # call of several tokens from the first layer's length, which the others do not match (its pipeline fails
        # there), while a call of one token needs no mask: then the question goes in a token at a time (the same
        # attention, causal within the question)
        step = 1 if len({cache.get_seq_length(i) for i in global_layers(model)}) > 1 else question.shape[1]
        for start in range(0, question.shape[1], step):
            logits = model(input_ids=question[:, start:start + step], past_key_values=cache,
                           position_ids=position[:, start:start + step], logits_to_keep=1).logits[0, -1]
    tokens = [int(logits.argmax())]
    for step in range(sample.max_new_tokens - 1):
        if tokens[-1] == tokenizer.eos_token_id:
            break
        position = torch.tensor([[len(sample.ids) + step]])
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=position).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokenizer.decode(tokens, skip_special_tokens=True), held


def table(rows: list[dict]) -> str:
    """Markdown: a line per method, a column per (task, library): RULER's score and the K/V tokens held after the
    context."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    libraries = list(dict.fromkeys(r["library"] for r in rows))
    lines = ["| method | " + " | ".join(f"{lib} {t}" for t in tasks for lib in libraries) + " |",
             "|---|" + "---|" * (len(tasks) * len(libraries))]
    for method in dict.fromkeys(r["policy"] for r in rows):
        cells = []
        for task in tasks:
            for library in libraries:
                found = [r for r in rows if r["library"] == library and r["policy"] == method and r["task"] == task]
                cells.append(f"{found[0]['score']:.2f} ({found[0]['kv_tokens']:,})" if found else "-")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2")
    parser.add_argument("--methods", default="snapkv,knorm,streaming,tova")
    parser.add_argument("--budget", default="0.5",
                        help="share of the context kept (kvpress: 1 - ratio); several, comma-separated, share one "
                             "full-cache row (kvpress's ratios 25/50/75/87.5%%: 0.75,0.5,0.25,0.125)")
    parser.add_argument("--haystack", default=str(data_dir() / "books" / "test" / "great_expectations.txt"))
    parser.add_argument("--libraries", default="kvpress,sparsegen,sparsegen-once",
                        help="sparsegen: its context protocol (the budget held through the question and answer); "
                             "sparsegen-once: its -once protocol (kvpress's exactly: nothing evicted after the press)")
    parser.add_argument("--protocol", choices=["context", "query-aware"], default="context",
                        help="context: the question after the press (kvpress's default); query-aware: the question "
                             "pressed with the context (kvpress's compress_questions, SnapKV's setting)")
    parser.add_argument("--window", type=int, default=None,
                        help="observation window of sparsegen's SnapKV-scored policies (default theirs, 32; kvpress's "
                             "presses use 64)")
    parser.add_argument("--scorer", help="kvzap's and kvzap-global's fitted scorer (`sparsegen fit-scorer`)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier runs' rows and exit")
    args = parser.parse_args()
    if args.table:
        rows = [r for f in args.table for r in json.loads(Path(f).read_text())["rows"]]
        print(table(rows))
        return
    libraries = args.libraries.split(",")
    methods = args.methods.split(",")
    budgets = [float(b) for b in args.budget.split(",")]
    unmatched = [m for m in methods if m not in PRESSES and m not in ADAPTIVE]
    if "kvpress" in libraries and unmatched:
        parser.error(f"no kvpress press is matched to {', '.join(unmatched)}; choose from "
                     f"{', '.join([*PRESSES, *ADAPTIVE])}")
    kvpress = __import__("kvpress") if "kvpress" in libraries else None  # (sparsegen's rows alone run without it)

    model, tokenizer = sparsegen.load(args.model)
    hay = ruler.Haystack(tokenizer, Path(args.haystack).read_text(encoding="utf-8", errors="replace"))
    chat = bool(getattr(tokenizer, "chat_template", None))
    samples = [s for task in args.tasks.split(",") for s in ruler.make_samples(hay, task, args.length, args.samples,
                                                                                  chat=chat)]
    rows = []

    def save() -> None:
        """The rows so far, rewritten after every method: a run cut short keeps what it measured."""
        if args.json:
            version = kvpress and getattr(kvpress, "__version__", "0.5.5")
            Path(args.json).write_text(json.dumps({"model": args.model, "kvpress": version, "transformers":
                                                   __import__("transformers").__version__,
                                                   "samples_per_task": args.samples, "rows": rows}, indent=2))

    def record(library: str, method: str, budget: float | None, results: list[dict], seconds: float,
               window: int | None = None) -> None:
        for task in dict.fromkeys(r["task"] for r in results):
            mine = [r for r in results if r["task"] == task]
            label = method if budget is None or len(budgets) == 1 else f"{method} {budget:.1%}"
            rows.append({"library": library, "policy": label, "budget": budget, "protocol": args.protocol,
                         "window": window,
                         "task": task, "length": args.length, "score": sum(r["score"] for r in mine) / len(mine),
                         "kv_tokens": max(r["kv_tokens"] for r in mine), "samples": mine,
                         "seconds_per_sample": round(seconds / len(results), 2)})
            print(f"{library:>9} {method:>10} {task:>16}: {rows[-1]['score']:.3f}", flush=True)
        save()

    # kvpress first: sparsegen's cache switches the model's attention to its own registered functions
    pressings = [("full", None)] + [(method, budget) for method in methods for budget in budgets]
    for method, budget in pressings if "kvpress" in libraries else []:
        press = None if method == "full" else make_press(kvpress, method, budget)
        t0, results = time.perf_counter(), []
        for sample in samples:
            pressed_tokens = len(sample.ids) if args.protocol == "query-aware" else sample.context_tokens
            if press is not None:  # as many tokens kept as sparsegen keeps: a share of the context, even query-aware
                press.compression_ratio = 1 - budget * sample.context_tokens / pressed_tokens
            answer, held = kvpress_answer(model, tokenizer, sample, press, args.protocol == "query-aware")
            results.append({"task": sample.task, "depth": sample.depth, "answer": answer, "answers": sample.answers,
                            "score": ruler.score(answer, sample.answers), "kv_tokens": held})
        record("kvpress", method, budget, results, time.perf_counter() - t0)
    protocols = {"sparsegen": args.protocol, "sparsegen-once": f"{args.protocol}-once"}
    for library in [lib for lib in libraries if lib in protocols]:
        for method, budget in pressings[1:]:
            t0 = time.perf_counter()
            known = policy_options(policy_class(method))
            options = {"window": args.window} if "window" in known else {}
            if "scorer" in known:
                options["scorer"] = args.scorer
            results = ruler.evaluate(model, tokenizer, samples,
                                     PolicySpec(method, budget, options),
                                     protocol=protocols[library], progress=False)
            for r, sample in zip(results, samples):
                r["kv_tokens"] = round(budget * sample.context_tokens)  # after the context
            record(library, method, budget, results, time.perf_counter() - t0, options.get("window"))

    print(f"\n{args.model}, RULER {args.length}, {args.samples} samples a task, {args.protocol} protocol, budget "
          f"{args.budget} of the context (kvpress keeping as many tokens)\n")
    print(table(rows))


if __name__ == "__main__":
    main()
