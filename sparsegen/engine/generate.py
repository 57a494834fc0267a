"""Generation with an eviction cache: chunked prefill at bounded memory, then a minimal decode loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.detokenize import Detokenizer
from sparsegen.engine.context import CompressedContext
from sparsegen.engine.prefill import prefill
from sparsegen.engine.sampling import GREEDY_BELOW, check_sampling, next_token
from sparsegen.engine.speculative import Speculation, draft_policy, speculative_tokens
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, Policy
from sparsegen.kv.cache import DEFAULT_CHUNK
from sparsegen.kv.quantized import policy_and_bits
from sparsegen.kv.spec import PolicySpec, as_spec
from sparsegen.models.anatomy import weights_of


@dataclass
class Generation:
    texts: list[str]
    new_tokens: list[int]
    prompt_tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    cache: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.texts[0]

    def to_dict(self) -> dict:
        decoded = sum(self.new_tokens)
        speculation = self.cache.get("speculation")
        return {
            "text": self.text if len(self.texts) == 1 else self.texts,
            "new_tokens": self.new_tokens[0] if len(self.texts) == 1 else self.new_tokens,
            "prompt_tokens": self.prompt_tokens[0] if len(self.texts) == 1 else self.prompt_tokens,
            "kv_tokens_peak": self.cache.get("kv_tokens_peak"),
            "kv_bytes_peak": self.cache.get("kv_bytes_peak"),
            "seconds": round(self.prefill_seconds + self.decode_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_tokens_per_s": round(decoded / self.decode_seconds, 2) if self.decode_seconds else None,
            **({"acceptance_rate": speculation["acceptance_rate"], "tokens_per_step": speculation["tokens_per_step"]}
               if speculation else {}),
            "cache": self.cache,
        }


@torch.inference_mode()
def generate_tokens(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    policy: PolicySpec | Policy,
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    eos_id: int | None = None,
    pad_id: int = 0,
    on_token: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    progress: bool | None = None,
    compile: bool | str | None = None,
    first_chunk: int | None = None,
    cache: EvictionCache | None = None,
    hold_after_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict, float, float]:
    """The token-level loop: ``(new [B, n], counts [B], cache stats, prefill s, decode s)``.

    ``policy``: the cache's settings (a bare ``Policy``: with its default positions, K/V unquantized; a fractional
    budget is of the first chunk, else of the prompt). ``ids``/``mask`` are left-padded. Rows stop at ``eos_id``
    (when given) and are then fed ``pad_id``; checking whether all have stopped is the loop's one host read per token,
    and only with ``eos_id``. ``compile``: the decode
    step through ``torch.compile`` (``DecodeStep``; None: where the weights are low-bit or on CUDA). ``first_chunk``:
    prefill that many tokens in one pass first (``prefill``). ``cache``: a cache already holding a context
    (``CompressedContext.cache``; then ``policy`` is its own) that ``ids`` continue.
    ``hold_after_first``: after the first chunk the cache evicts nothing more (kvpress's exact protocol: the context
    compressed once, the question and the answer all held).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    check_sampling(temperature, top_p, seed)
    device = ids.device
    batch, length = ids.shape
    start = 0
    if cache is None:
        spec = policy if isinstance(policy, PolicySpec) else PolicySpec(policy)
        cache = spec.cache(model, first_chunk or length, chunk_size=chunk_size, expected_length=length + max_new_tokens)
    elif cache.seen is not None:
        if cache.seen.shape[0] != batch:
            raise ValueError(f"the cache holds {cache.seen.shape[0]} sequences; ids has {batch}")
        start = cache.length - cache.pinned  # positions continue after what it holds
    generator = torch.Generator(device=device).manual_seed(seed) if temperature >= GREEDY_BELOW else None

    t0 = time.perf_counter()
    if hold_after_first and first_chunk:  # (a first chunk of the whole prompt leaves nothing more to feed)
        logits = prefill(model, cache, ids[:, :first_chunk], mask[:, :first_chunk], chunk_size, progress,
                         first_chunk, start)
        cache.stop_evicting()
        ids, mask, start = ids[:, first_chunk:], mask[:, first_chunk:], start + first_chunk
    elif hold_after_first:
        cache.stop_evicting()
    if ids.shape[1]:
        logits = prefill(model, cache, ids, mask, chunk_size, progress, None if hold_after_first else first_chunk,
                         start)
    prefill_seconds = time.perf_counter() - t0

    step = DecodeStep(model, compile)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    new = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    counts = torch.zeros(batch, dtype=torch.long, device=device)
    position = mask.sum(-1) + start
    t0 = time.perf_counter()
    for index in range(max_new_tokens):
        token = torch.where(finished, pad_id, next_token(logits, temperature, top_p, generator))
        counts += ~finished
        new[:, index] = token
        if eos_id is not None:
            finished |= token == eos_id
        if on_token is not None:
            on_token(new[:, :index + 1], counts)
        if index == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
            new = new[:, :index + 1]
            break
        logits = step(cache, token, position)
        position = position + 1
    stats = {**cache.stats(), "weights": weights_of(model), "compiled": step.compiled,
             "compile_seconds": step.compile_seconds}
    return new, counts, stats, prefill_seconds, time.perf_counter() - t0


def generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: str | list[str] | None = None,
    policy: str | Policy | PolicySpec = "full",
    budget: int | float | str | None = None,
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    stop_at_eos: bool = True,
    on_text: Callable[[str], None] | None = None,
    progress: bool | None = None,
    speculative: str | Policy | None = None,
    draft_tokens: int | str = 4,
    draft_model: torch.nn.Module | None = None,
    compile: bool | str | None = None,
    context: str | CompressedContext | None = None,
    question: str | None = None,
    evict_after_context: bool = True,
) -> Generation:
    """Continue ``prompts`` under a KV policy. Greedy when ``temperature`` is 0.

    ``policy``: a name with ``budget`` beside it (``"h2o", 0.2``: a fraction is of the prompt), a ``Policy``, or a
    ``PolicySpec`` with the policy's options, its positions and ``kv_bits`` (8, 4 or 2: the cache's keys and values
    held quantized, KIVI-style, under any policy; 16: as float16 numbers).

    A prompt of any length is encoded in chunks of ``chunk_size`` tokens with eviction between chunks,
    so the cache never holds more than the budget plus one chunk. ``on_text`` receives the new text of
    the first sequence as it is produced.

    ``speculative`` (``"streaming:512"``, ``"h2o:0.1"`` or a ``Policy``): decode losslessly under the full cache,
    drafting ``draft_tokens`` tokens at a time (a count, or ``"auto"``) with the model (or ``draft_model``, same
    vocabulary) over a cache under that policy; ``policy`` must then be ``full``.

    ``compile``: run the decode step through ``torch.compile`` (the first call of a shape compiles, kept in
    sparsegen's cache folder): ``"regional"`` (a block of decoder layers compiled once for every block: seconds),
    ``"whole"`` (the step one graph: a faster step, minutes to compile), True (regional on a CPU, whole on CUDA),
    False (eager); None (default): compiled where the weights are low-bit, as ``sparsegen.load`` gives a GGUF model
    by default, or on CUDA (``compile_mode``).

    ``context`` and ``question`` instead of ``prompts``: kvpress's protocol. The context is encoded in one pass and
    compressed once to the budget (a fraction is of the context) by the policy's scores; then the question is fed
    and the answer decoded, eviction continuing. ``context`` may be a ``CompressedContext`` (``compress``, or
    ``CompressedContext.load``): the compression is then done once for many questions, under its own policy.
    ``evict_after_context=False``: nothing is evicted after the context (kvpress's exact protocol: the cache grows by
    the question and the answer); by default the budget holds through them.

    (Over 60 lines for its 21 documented arguments; the work is in the helpers below and ``generate_tokens``.)
    """
    device = next(model.parameters()).device
    spec = as_spec(policy, budget)
    first_chunk, cache, context_tokens = None, None, 0
    if context is not None or question is not None:
        if speculative is not None:
            raise ValueError("speculative decoding takes prompts, not a context and a question")
        ids, prompts, first_chunk, cache = _context_inputs(model, tokenizer, prompts, context, question, spec)
        if cache is not None:
            context_tokens = context.tokens
        mask = torch.ones_like(ids)
    else:
        ids, mask, prompts = _prompt_inputs(tokenizer, prompts, device)
    speculation = _speculation(speculative, spec, draft_tokens, draft_model, ids.shape[1])
    text = Detokenizer(tokenizer)

    def stream_text(new: torch.Tensor, counts: torch.Tensor) -> None:
        for token in new[0, len(text.tokens):int(counts[0])].tolist():  # the first row's tokens not shown yet
            piece = text.add(token)
            if piece:
                on_text(piece)

    common = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  chunk_size=chunk_size, eos_id=tokenizer.eos_token_id if stop_at_eos else None,
                  pad_id=tokenizer.pad_token_id or 0, on_token=stream_text if on_text is not None else None,
                  progress=progress)
    if speculation is not None:
        new, counts, stats, prefill_seconds, decode_seconds = speculative_tokens(model, ids, mask, speculation,
                                                                                 compile=compile, **common)
    else:
        hold = not evict_after_context and context is not None
        new, counts, stats, prefill_seconds, decode_seconds = generate_tokens(
            model, ids, mask, spec, compile=compile, first_chunk=first_chunk, cache=cache, hold_after_first=hold,
            **common)
    if on_text is not None and (tail := text.flush()):
        on_text(tail)
    return Generation(
        texts=[tokenizer.decode(new[row, : counts[row]], skip_special_tokens=True) for row in range(len(prompts))],
        new_tokens=counts.tolist(), prompt_tokens=(mask.sum(-1) + context_tokens).tolist(),
        prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, cache=stats,
    )


def _prompt_inputs(tokenizer, prompts, device: torch.device):
    """Prompts' ids and mask, left-padded to one length, and the prompts as a list."""
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("prompts must be a non-empty string or a non-empty list of non-empty strings")
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device), list(prompts)


def _context_inputs(model, tokenizer, prompts, context, question, spec: PolicySpec):
    """kvpress's protocol's inputs: the ids to feed, the prompt as reported, where the context ends (None for a
    compressed context, whose cache is returned, holding it)."""
    compressed = isinstance(context, CompressedContext)
    if prompts is not None or not (compressed or isinstance(context, str) and context) \
            or not (isinstance(question, str) and question):
        raise ValueError("give prompts, or a context (text or a CompressedContext) and a non-empty question "
                         "(kvpress's protocol), not both")
    device = next(model.parameters()).device
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    if compressed:
        if spec != PolicySpec():
            raise ValueError(f"a compressed context carries its policy, budget, positions and kv_bits: drop {spec}")
        return torch.tensor([question_ids], device=device), [question], None, context.cache(model)
    context_ids = tokenizer(context)["input_ids"]
    return torch.tensor([context_ids + question_ids], device=device), [context + question], len(context_ids), None


def _speculation(speculative, spec: PolicySpec, draft_tokens, draft_model, length: int) -> Speculation | None:
    """What speculative decoding was asked for, checked against the rest of the call."""
    if speculative is None:
        if draft_model is not None:
            raise ValueError("draft_model drafts for speculative decoding: give speculative too, e.g. "
                             "'streaming:512'")
        return None
    if spec.kv_bits is not None:
        raise ValueError("speculative decoding verifies with the model's own full cache: drop kv_bits")
    if spec.bounded:
        raise ValueError("speculative decoding verifies with the full cache: leave the policy at 'full' (the draft "
                         "cache takes its policy from speculative, e.g. 'streaming:512')")
    return Speculation(draft_policy(speculative, length), draft_tokens, spec.positions, draft_model)


@torch.inference_mode()
def compress(
    model: torch.nn.Module,
    tokenizer,
    context: str,
    policy: str | Policy | PolicySpec = "full",
    budget: int | float | str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> CompressedContext:
    """kvpress's first half, done once: ``context`` encoded in one pass and compressed to the budget (a fraction is
    of the context) by the policy's scores (``policy`` and ``budget`` as ``generate`` takes them). Ask it any number
    of questions with ``generate(context=..., question=...)`` or save it (``.save(path)``;
    ``CompressedContext.load(path, model)``)."""
    if not isinstance(context, str) or not context:
        raise ValueError("context must be a non-empty string")
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer(context)["input_ids"]], device=device)
    cache = as_spec(policy, budget).cache(model, ids.shape[1], chunk_size=chunk_size)
    prefill(model, cache, ids, torch.ones_like(ids), chunk_size, first_chunk=ids.shape[1])
    return CompressedContext.of(model, cache, ids, context)


def compare(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    policies: list[str],
    budget: int | float | str = 128,
    max_new_tokens: int = 48,
    chunk_size: int = DEFAULT_CHUNK,
    draft_tokens: int | str = 4,
    draft_model: torch.nn.Module | None = None,
    compile: bool | str | None = None,
) -> dict[str, dict]:
    """The same prompt under each of ``policies``, greedy, never stopping early: name -> ``Generation.to_dict()``.
    A name is ``full``, a policy taking ``budget``, either with ``+kvN`` to hold the cache in N bits (``h2o+kv4``), or
    ``speculative:POLICY[:BUDGET]`` (lossless under the full cache, drafting from POLICY, at ``budget`` unless one is
    given)."""
    rows = {}
    for name in policies:
        draft = name.removeprefix("speculative:") if name.startswith("speculative:") else None
        if draft is not None and ":" not in draft:
            draft = f"{draft}:{budget}"
        policy, bits = policy_and_bits(name)
        spec = PolicySpec() if draft else PolicySpec.sharing(policy, budget, kv_bits=bits)
        rows[name] = generate(
            model, tokenizer, prompt, spec, max_new_tokens=max_new_tokens, chunk_size=chunk_size, stop_at_eos=False,
            speculative=draft, draft_tokens=draft_tokens, draft_model=draft_model if draft else None, compile=compile,
        ).to_dict()
    return rows
