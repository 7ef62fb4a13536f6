"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.request import Request


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

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device) -> SamplingBatch:
        params = [r.params for r in requests]
        # k past the vocabulary keeps every token, as 0 does; capped here because a k past
        # int64 would fail the whole launch, every request batched with it included.
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([p.temperature or 1.0 for p in params], device=device),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
            greedy_rows=torch.tensor([p.greedy for p in params], device=device),
            generators=[r.generator for r in requests],
            want_logprobs=any(p.logprobs for p in params),
        )


def worst_case_sampling(rows: int, device) -> SamplingBatch:
    """Every row filtered by top-k and top-p with logprobs: the sampler's largest footprint."""
    return SamplingBatch(
        temperature=torch.ones(rows, device=device),
        top_k=torch.full((rows,), 50, device=device),
        top_p=torch.full((rows,), 0.9, device=device),
        all_greedy=False, any_top_k=True, any_top_p=True,
        greedy_rows=torch.zeros(rows, dtype=torch.bool, device=device),
        generators=[None] * rows, want_logprobs=True)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (token ids [B], logprobs of those tokens under the model's distribution [B])."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy
    else:
        probs = _filtered_probs(logits / batch.temperature[:, None], batch)
        tokens = torch.where(batch.greedy_rows, greedy, _draw(probs, batch.generators))
    logprobs = None
    if batch.want_logprobs:
        logprobs = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not (batch.any_top_k or batch.any_top_p):
        return logits.softmax(-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= batch.top_k[:, None]
    if batch.any_top_p:
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= batch.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(-1)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # Exponential race (argmax p/E, E ~ Exp(1)) samples from p without a host sync; seeded
    # rows draw their noise on the CPU from their own generator so results do not depend
    # on the batch they happen to share.
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            cpu_noise = torch.empty(probs.shape[-1]).exponential_(generator=generator)
            noise[row] = cpu_noise.to(probs.device, non_blocking=True)
    return (probs / noise).argmax(dim=-1)
