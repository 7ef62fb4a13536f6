"""A minimal paged-cache driver for the model: builds AttentionMetadata by hand.

Tests (and quick demos) use it to run prefill, chunked prefill and decode steps without the
engine's scheduler or block allocator. Pages are handed out in order and never freed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.model.arch import ModelArch
from pdserve.model.llama import KVCache, LlamaForCausalLM
from pdserve.ops.metadata import AttentionMetadata


def make_kv_caches(arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> list[KVCache]:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(arch.num_layers)]


def build_metadata(num_cached: list[int], num_new: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu",
                   num_decode_seqs: int | None = None) -> AttentionMetadata:
    """Metadata for sequences with ``num_cached`` tokens already in the cache plus ``num_new``.

    Sequences must come decode-first; by default the leading run of one-token sequences
    that already have context counts as decode.
    """
    if num_decode_seqs is None:
        num_decode_seqs = 0
        while (num_decode_seqs < len(num_new) and num_new[num_decode_seqs] == 1
               and num_cached[num_decode_seqs] > 0):
            num_decode_seqs += 1
    seq_lens = [c + n for c, n in zip(num_cached, num_new, strict=True)]
    slots = [_slot(table, pos, block_size) for table, c, n in
             zip(block_tables, num_cached, num_new, strict=True) for pos in range(c, c + n)]
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        num_seqs=len(num_new), num_decode_seqs=num_decode_seqs,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(num_new), max_seq_len=max(seq_lens), block_size=block_size,
        max_extend_prefix_len=max(num_cached[num_decode_seqs:], default=0),
    )


def _slot(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0


class PagedRunner:
    """Runs a model step by step over its own small paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4,
                 ) -> None:
        param = next(model.parameters())
        self.model, self.block_size, self.device = model, block_size, param.device
        self.kv_caches = make_kv_caches(model.arch, num_blocks, block_size, param.dtype,
                                        param.device)
        self.num_blocks = num_blocks
        self._next_page = 1  # page 0 stays empty: block tables are padded with it
        self._seqs: dict[object, _Seq] = {}

    def _grow(self, seq: _Seq, new_len: int) -> None:
        while len(seq.pages) * self.block_size < new_len:
            if self._next_page >= self.num_blocks:
                raise RuntimeError("test KV cache is full")
            seq.pages.append(self._next_page)
            self._next_page += 1

    @torch.no_grad()
    def step(self, batch: list[tuple[object, list[int]]]) -> torch.Tensor:
        """Advances each (seq_id, new_token_ids), decode-first; logits of each last token."""
        seqs = [self._seqs.setdefault(seq_id, _Seq()) for seq_id, _ in batch]
        num_new = [len(ids) for _, ids in batch]
        num_cached = [s.num_cached for s in seqs]
        for seq, c, n in zip(seqs, num_cached, num_new, strict=True):
            self._grow(seq, c + n)
        meta = build_metadata(num_cached, num_new, [s.pages for s in seqs], self.block_size,
                              self.device)
        input_ids = torch.tensor([t for _, ids in batch for t in ids], device=self.device)
        positions = torch.tensor([p for c, n in zip(num_cached, num_new, strict=True)
                                  for p in range(c, c + n)], device=self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        for seq, n in zip(seqs, num_new, strict=True):
            seq.num_cached += n
        last_rows = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last_rows])


def greedy_step_logits(model: LlamaForCausalLM, prompts: list[list[int]], steps: int,
                       num_blocks: int = 16, block_size: int = 4) -> list[torch.Tensor]:
    """A batched prefill of ``prompts``, then ``steps`` greedy decode steps of all of them:
    the logits of every step (to compare two paths of one model step by step)."""
    runner = PagedRunner(model, num_blocks=num_blocks, block_size=block_size)
    logits = [runner.step(list(enumerate(prompts)))]
    for _ in range(steps):
        next_ids = logits[-1].argmax(-1).tolist()
        logits.append(runner.step([(i, [t]) for i, t in enumerate(next_ids)]))
    return logits


def greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    block_size: int = 4) -> list[list[int]]:
    """Prefills all prompts as one batch, then decodes them together (no EOS stop)."""
    need = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts) + 1
    runner = PagedRunner(model, num_blocks=need, block_size=block_size)
    logits = runner.step(list(enumerate(prompts)))
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(-1).tolist()
        for out, tok in zip(outputs, next_ids, strict=True):
            out.append(tok)
        if step + 1 < max_new_tokens:
            logits = runner.step([(i, [tok]) for i, tok in enumerate(next_ids)])
    return outputs


def write_hub_cache(cache_dir: str | Path, repo_id: str, folder: str | Path,
                    ref: str = "main") -> Path:
    """Puts checkpoint ``folder`` into a Hugging Face hub cache as ``huggingface_hub`` lays it
    out (content-addressed blobs, a snapshot of links, ``refs/<ref>``); returns the snapshot.

    Lets tests load a model by hub id with ``HF_HUB_OFFLINE=1`` and no network.
    """
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in files:
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        link = snapshot / path.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
