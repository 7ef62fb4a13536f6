"""Batched sampling in one pass on the device: logit bias, presence / frequency / repetition
penalties, grammar bitmasks (structured output), greedy, temperature, min-p, top-k, top-p,
per-request seeds, logprobs and the top alternatives.

Order as vLLM's sampler: logprobs come from the model's raw logits; bias, then penalties
change the logits that greedy and sampling see; temperature, min-p, top-k and top-p only
shape the distribution that is sampled.

Every per-row setting becomes a device tensor once per step. Penalties need each request's
token counts: the host lists the (row, token) pairs as flat indices and copies them in one
transfer; the counts are then built on the device with one ``index_add_``. Nothing here
waits for the device.

Bad words: the host lists each row's refused tokens (what its output ends with decides
them) as flat indices, set to -inf.

Rows with ``allowed_token_ids`` send their (row, token) pairs as flat indices; the device
builds their mask and sets -inf on every other token, as for grammar rows.

Grammar rows: the host fills their bitmask (``GrammarRows.fill``) after the step's forward
is issued, so it runs while the device computes; one copy sends it, and only those rows are
masked (-inf on every token the grammar does not allow). Rows without a grammar pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.ops import dispatch as ops
from pdserve.request import Request
from pdserve.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from pdserve.structured.grammars import Matcher, fill_bitmask

TOP_K_FIRST_LIMIT = 1024
"""Up to this k, top-k (and top-p inside it) runs on ``torch.topk`` instead of sorting the
whole vocabulary; past it a full sort is as cheap and keeps one code path."""


@dataclass
class Penalties:
    """Per-row penalty settings and the token counts they act on, on the device."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor | None  # [B] float32; None when no row uses it
    output_counts: torch.Tensor  # [B, V] float32: times each token was generated
    prompt_seen: torch.Tensor | None  # [B, V] bool: tokens in the prompt (repetition only)


@dataclass
class LogitBias:
    flat_index: torch.Tensor  # row * vocab + token
    values: torch.Tensor


@dataclass
class AllowedTokens:
    """Rows restricted to a list of tokens (``allowed_token_ids``): the (row, token) pairs
    they allow, as flat indices into the step's rows' logits."""

    rows: torch.Tensor  # [R] int64: the restricted rows
    flat_allowed: torch.Tensor  # [N] int64: k * vocab + token, k indexing ``rows``


@dataclass
class GrammarRows:
    """The rows sampled under a grammar: their matchers (host), row ids and, once filled,
    their bitmask of allowed tokens (device)."""

    rows: torch.Tensor  # [G] int64
    matchers: list[Matcher]
    vocab_size: int
    allowed: torch.Tensor | None = None  # [G, ceil(vocab / 32)] int32

    def fill(self) -> None:
        """Computes the bitmask on the host and copies it to the device without waiting."""
        device = self.rows.device
        host = fill_bitmask(self.matchers, self.vocab_size, pin=device.type == "cuda")
        self.allowed = host.to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors, built once per step."""

    temperature: torch.Tensor  # [B] float32, 1.0 where greedy (unused there)
    top_k: torch.Tensor  # [B] int64, vocab size where disabled
    top_p: torch.Tensor  # [B] float32
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    greedy_rows: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]
    want_logprobs: bool
    num_top_logprobs: int = 0  # most alternatives any row asked for
    min_p: torch.Tensor | None = None  # [B] float32; None when no row uses it
    top_k_width: int | None = None  # k of the top-k-first path; None: sort the vocabulary
    penalties: Penalties | None = None
    logit_bias: LogitBias | None = None
    allowed: AllowedTokens | None = None
    refused_by_bad_words: torch.Tensor | None = None  # [N] int64: row * vocab + token
    grammar: GrammarRows | None = None
    any_greedy: bool = True  # False skips the greedy argmax of a batch that samples every row

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device) -> SamplingBatch:
        params = [r.params for r in requests]
        # k past the vocabulary keeps every token, as 0 does; capped here because a k past
        # int64 would fail the whole launch, every request batched with it included.
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        return cls(
            temperature=_row_values([p.temperature or 1.0 for p in params], np.float32, device),
            top_k=_row_values(top_k, np.int64, device),
            top_p=_row_values(top_p, np.float32, device),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            greedy_rows=_row_values([p.greedy for p in params], np.bool_, device),
            generators=[r.generator for r in requests],
            want_logprobs=any(p.logprobs for p in params),
            num_top_logprobs=num_top_logprobs(params),
            min_p=_min_p(params, device),
            top_k_width=_top_k_width(top_k, top_p, vocab_size),
            penalties=_penalties(requests, vocab_size, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            allowed=_allowed_tokens(requests, vocab_size, device),
            refused_by_bad_words=_refused_by_bad_words(requests, vocab_size, device),
            grammar=_grammar_rows(requests, vocab_size, device),
            any_greedy=any(p.greedy for p in params),
        )


def _grammar_rows(requests: list[Request], vocab_size: int, device) -> GrammarRows | None:
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    return GrammarRows(_to_device(np.asarray(rows, dtype=np.int64), device),
                       [requests[i].grammar for i in rows], vocab_size)


def num_top_logprobs(params: list[SamplingParams]) -> int:
    """How many alternatives a step returns per row: the most any of its rows asked for."""
    return max((p.top_logprobs for p in params if p.logprobs), default=0)


def _min_p(params, device) -> torch.Tensor | None:
    if all(p.min_p == 0 for p in params):
        return None
    return _row_values([p.min_p for p in params], np.float32, device)


def _top_k_width(top_k: list[int], top_p: list[float], vocab_size: int) -> int | None:
    """The k to take with ``torch.topk`` when every filtering row has a top-k within the
    limit; a row with top-p but no top-k needs the whole vocabulary sorted (None)."""
    widths = [k for k, p in zip(top_k, top_p, strict=True) if k < vocab_size or p < 1.0]
    if not widths or max(widths) > min(TOP_K_FIRST_LIMIT, vocab_size - 1):
        return None
    return max(widths)


def _penalties(requests: list[Request], vocab_size: int, device) -> Penalties | None:
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return None
    params = [r.params for r in requests]
    use_repetition = any(p.repetition_penalty != 1 for p in params)
    outputs = [_flat(i, _output_ids(requests[i]), vocab_size) for i in rows]
    prompts = [_flat(i, _prompt_ids(requests[i]), vocab_size) for i in rows] \
        if use_repetition else []
    num_output = sum(len(f) for f in outputs)
    flat = _to_device(np.concatenate(outputs + prompts), device)  # the one copy
    output_index, prompt_index = flat[:num_output], flat[num_output:]
    shape = (len(requests), vocab_size)
    counts = torch.zeros(shape[0] * vocab_size, device=device)
    counts.index_add_(0, output_index, torch.ones_like(output_index, dtype=counts.dtype))
    seen = None
    if use_repetition:
        seen = torch.zeros(shape[0] * vocab_size, dtype=torch.bool, device=device)
        seen[prompt_index] = True
        seen = seen.view(shape)
    return Penalties(
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device)
        if use_repetition else None,
        output_counts=counts.view(shape), prompt_seen=seen)


def _output_ids(request: Request) -> list[int]:
    return request.token_ids[request.num_prompt_tokens:]


def _prompt_ids(request: Request) -> np.ndarray:
    # The prompt never changes: its distinct ids are worked out once per request.
    if request.distinct_prompt_ids is None:
        request.distinct_prompt_ids = np.unique(np.asarray(request.prompt_token_ids))
    return request.distinct_prompt_ids


def _flat(row: int, token_ids, vocab_size: int) -> np.ndarray:
    return np.asarray(token_ids, dtype=np.int64) + row * vocab_size


def _row_values(values: list, dtype, device) -> torch.Tensor:
    # Not torch.tensor(values, device=...): its copy waits for the stream, and under overlap
    # scheduling the stream is running the step before this one.
    return _to_device(np.asarray(values, dtype=dtype), device)


def _to_device(array: np.ndarray, device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()  # a pageable copy would wait for the stream to drain
    return tensor.to(device, non_blocking=True)


def _logit_bias(params, vocab_size: int, device) -> LogitBias | None:
    pairs = [(row * vocab_size + t, b) for row, p in enumerate(params)
             for t, b in p.logit_bias.items()]
    if not pairs:
        return None
    index, values = zip(*pairs, strict=True)
    return LogitBias(_to_device(np.asarray(index, dtype=np.int64), device),
                     _to_device(np.asarray(values, dtype=np.float32), device))


def _allowed_tokens(requests: list[Request], vocab_size: int, device
                    ) -> AllowedTokens | None:
    rows = [row for row, r in enumerate(requests) if r.allowed_ids is not None]
    if not rows:
        return None
    flat = np.concatenate([k * vocab_size + requests[row].allowed_ids
                           for k, row in enumerate(rows)])
    return AllowedTokens(_to_device(np.asarray(rows, dtype=np.int64), device),
                         _to_device(flat, device))


def _refused_by_bad_words(requests: list[Request], vocab_size: int, device
                          ) -> torch.Tensor | None:
    flat = [row * vocab_size + token for row, r in enumerate(requests) if r.bad_words
            for token in sorted(r.refused_by_bad_words()) if token < vocab_size]
    return _to_device(np.asarray(flat, dtype=np.int64), device) if flat else None


def bad_word_token_ids(words: list[str], encode) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token ids, as vLLM reads them: each word as it starts a text, and
    after a space where the space joins the word's first token (same length, another first
    token) as it does inside a text in most vocabularies."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return tuple(dict.fromkeys(s for s in sequences if s))


def worst_case_sampling(rows: int, vocab_size: int, device) -> SamplingBatch:
    """Every row penalized, filtered by min-p and top-p over the sorted vocabulary, with 20
    alternatives: the sampler's largest footprint."""
    counts = torch.zeros(rows, vocab_size, device=device)
    return SamplingBatch(
        temperature=torch.ones(rows, device=device),
        top_k=torch.full((rows,), vocab_size, device=device),
        top_p=torch.full((rows,), 0.9, device=device),
        all_greedy=False, any_top_k=False, any_top_p=True,
        greedy_rows=torch.zeros(rows, dtype=torch.bool, device=device),
        generators=[None] * rows, want_logprobs=True, num_top_logprobs=MAX_TOP_LOGPROBS,
        any_greedy=False,
        min_p=torch.full((rows,), 0.05, device=device),
        penalties=Penalties(
            presence=torch.full((rows,), 0.5, device=device),
            frequency=torch.full((rows,), 0.5, device=device),
            repetition=torch.full((rows,), 1.1, device=device), output_counts=counts,
            prompt_seen=torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)))


@dataclass
class SampledLogprobs:
    """Logprobs under the model's raw distribution, on the device."""

    sampled: torch.Tensor  # [B] of the sampled tokens
    top_ids: torch.Tensor | None  # [B, K] most likely tokens, best first; None when K = 0
    top_values: torch.Tensor | None  # [B, K]


def sample(logits: torch.Tensor, batch: SamplingBatch
           ) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """Returns (token ids [B], their logprobs and the top alternatives when asked for)."""
    raw = logits.float()
    logits = _penalized(_biased(raw, batch.logit_bias), batch.penalties)
    if batch.refused_by_bad_words is not None:  # out of place: the raw logits stay intact
        logits = logits.flatten().index_fill(0, batch.refused_by_bad_words,
                                             float("-inf")).view_as(logits)
    logits = _constrained(_restricted(logits, batch.allowed), batch.grammar)
    if batch.all_greedy:
        tokens = ops.row_argmax(logits)
    else:
        tokens = _draw(_filtered_logits(logits / batch.temperature[:, None], batch),
                       batch.generators)
        if batch.any_greedy:  # a batch without greedy rows skips this argmax
            tokens = torch.where(batch.greedy_rows, ops.row_argmax(logits), tokens)
    logprobs = _logprobs(raw, tokens, batch.num_top_logprobs) if batch.want_logprobs else None
    return tokens, logprobs


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_top: int) -> SampledLogprobs:
    all_logprobs = raw.log_softmax(-1)
    sampled = all_logprobs.gather(1, tokens[:, None]).squeeze(1)
    if num_top == 0:
        return SampledLogprobs(sampled, None, None)
    top = all_logprobs.topk(num_top, dim=-1)
    return SampledLogprobs(sampled, top.indices, top.values)


def _biased(logits: torch.Tensor, bias: LogitBias | None) -> torch.Tensor:
    if bias is None:
        return logits
    # Out of place: the raw logits still give the logprobs.
    return logits.flatten().index_add(0, bias.flat_index, bias.values).view_as(logits)


def _restricted(logits: torch.Tensor, allowed: AllowedTokens | None) -> torch.Tensor:
    if allowed is None:
        return logits
    refused = torch.ones(allowed.rows.shape[0] * logits.shape[-1], dtype=torch.bool,
                         device=logits.device)
    refused[allowed.flat_allowed] = False
    return _refuse(logits, allowed.rows, refused.view(-1, logits.shape[-1]))


def _constrained(logits: torch.Tensor, grammar: GrammarRows | None) -> torch.Tensor:
    if grammar is None:
        return logits
    if grammar.allowed is None:
        grammar.fill()  # a caller that did not fill it while the forward ran
    # Token t is bit t % 32 of word t // 32; read as little-endian bytes that is bit t % 8
    # of byte t // 8, and one AND with the 8 bit values unpacks every byte at once.
    byte_bits = torch.tensor(_BYTE_BITS, dtype=torch.uint8, device=logits.device)
    packed = grammar.allowed.view(torch.uint8)
    refused = (packed[:, :, None] & byte_bits).eq(0).flatten(1)[:, :logits.shape[-1]]
    return _refuse(logits, grammar.rows, refused)


def _refuse(logits: torch.Tensor, rows: torch.Tensor, refused: torch.Tensor) -> torch.Tensor:
    """-inf on the ``refused`` tokens of ``rows``; out of place: the raw logits stay intact."""
    if rows.shape[0] == logits.shape[0]:  # every row (rows are ascending, one per row)
        return logits.masked_fill(refused, float("-inf"))
    restricted = logits.index_select(0, rows).masked_fill(refused, float("-inf"))
    return logits.index_copy(0, rows, restricted)


_BYTE_BITS = [1 << i for i in range(8)]


def _penalized(logits: torch.Tensor, penalties: Penalties | None) -> torch.Tensor:
    if penalties is None:
        return logits
    counts = penalties.output_counts
    generated = counts > 0
    if penalties.repetition is not None:
        seen = generated | penalties.prompt_seen
        scale = torch.where(seen, penalties.repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - penalties.frequency[:, None] * counts
    return logits - penalties.presence[:, None] * generated


def _filtered_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The temperature-scaled logits with every token that min-p, top-k or top-p drop at
    -inf: their softmax is the distribution drawn from (the draw needs no softmax)."""
    if batch.min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed.
        floor = logits.amax(-1, keepdim=True) + batch.min_p.log()[:, None]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if not (batch.any_top_k or batch.any_top_p):
        return logits
    if batch.top_k_width is not None:
        return _top_k_first(logits, batch, batch.top_k_width)
    return _sorted_filter(logits, batch)


def _top_k_first(logits: torch.Tensor, batch: SamplingBatch, width: int) -> torch.Tensor:
    """Top-k, and top-p among those k, on ``torch.topk``'s ``width`` best (sorted) only."""
    values, order = logits.topk(width, dim=-1)
    kept = _keep_in_sorted(values, batch)
    filtering = (batch.top_k < logits.shape[-1]) | (batch.top_p < 1.0)
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, kept)
    return torch.where(filtering[:, None], filtered, logits)


def _sorted_filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kept = _keep_in_sorted(sorted_logits, batch)
    return torch.full_like(logits, float("-inf")).scatter(1, order, kept)


def _keep_in_sorted(sorted_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Sorted logits with those past each row's top-k and top-p set to -inf."""
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)[None, :]
    drop = ranks >= batch.top_k[:, None]
    if batch.any_top_p:
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= batch.top_p[:, None]
    return sorted_logits.masked_fill(drop, float("-inf"))


def _draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # Exponential race (argmax p/E, E ~ Exp(1)) samples from p = softmax(logits) without a
    # host sync. Taken as argmax(logits - log E), the same race in log space, it needs no
    # softmax: at batch 1 torch's softmax over a 128K vocabulary was a 34 us single-block
    # kernel on the H200. Seeded rows draw their noise on the CPU from their own generator
    # so results do not depend on the batch they happen to share.
    noise = torch.empty_like(logits).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            cpu_noise = torch.empty(logits.shape[-1]).exponential_(generator=generator)
            noise[row] = _to_device(cpu_noise.numpy(), logits.device)
    return ops.row_argmax(logits, noise)

