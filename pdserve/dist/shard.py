"""Which part of each weight and KV head one tensor-parallel rank holds.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel), o_proj and
down_proj by input columns (row-parallel, summed by an all-reduce), the embedding and the
LM head by vocabulary rows. The vocabulary is padded up to a multiple of the group size;
padded rows are zero and their logits are cut off before sampling. With fewer KV heads than
ranks, each KV head is replicated on the ranks whose query heads read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # dist/ sits below model/: it reads the shapes, never imports the module
    from pdserve.model.arch import ModelArch

# (dimension, start, stop, the tensor's full extent along it) of what one rank loads.
Slice = tuple[int, int, int, int]


def tp_refusal(arch: ModelArch, size: int) -> str | None:
    """Why ``arch`` cannot be split ``size`` ways (one line), or None when it can."""
    if size < 1:
        return f"--tensor-parallel-size must be at least 1, not {size}"
    if arch.num_heads % size:
        return (f"--tensor-parallel-size {size} does not divide the model's "
                f"{arch.num_heads} attention heads")
    if arch.num_kv_heads < size and size % arch.num_kv_heads:
        return (f"--tensor-parallel-size {size} is not a multiple of the model's "
                f"{arch.num_kv_heads} KV heads (needed to replicate them)")
    if arch.intermediate_size % size:
        return (f"--tensor-parallel-size {size} does not divide the MLP's intermediate size "
                f"{arch.intermediate_size}")
    return None


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``; ``arch`` is the whole model's."""

    arch: ModelArch
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        why = tp_refusal(self.arch, self.size)
        if why is not None:
            raise ValueError(why)

    @property
    def num_heads(self) -> int:
        return self.arch.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.arch.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        """First KV head this rank holds: the one its first query head reads."""
        group = self.arch.num_heads // self.arch.num_kv_heads
        return self.rank * self.num_heads // group

    @property
    def intermediate_size(self) -> int:
        return self.arch.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (unpadded) vocabulary rows this rank holds; the last rank may hold fewer."""
        return max(0, min(self.vocab_per_rank, self.arch.vocab_size - self.vocab_start))

    def rank_arch(self) -> ModelArch:
        """The shapes this rank's layers and KV pages have (the vocabulary stays whole)."""
        if self.size == 1:
            return self.arch
        return replace(self.arch, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate_size)

    def slice_of(self, name: str) -> Slice | None:
        """The part of checkpoint tensor ``name`` (an HF name) this rank loads; None: all."""
        if self.size == 1:
            return None
        kind = name.split(".")[-2] if name.endswith((".weight", ".bias")) else ""
        is_weight = name.endswith(".weight")
        arch, d = self.arch, self.arch.head_dim
        heads = (self.rank * self.num_heads * d, self.num_heads * d, arch.q_size)
        kv_heads = (self.kv_head_start * d, self.num_kv_heads * d, arch.kv_size)
        mlp = (self.rank * self.intermediate_size, self.intermediate_size,
               arch.intermediate_size)
        vocab = (self.vocab_start, self.vocab_rows, arch.vocab_size)
        rows = {"q_proj": heads, "k_proj": kv_heads, "v_proj": kv_heads, "gate_proj": mlp,
                "up_proj": mlp, "embed_tokens": vocab, "lm_head": vocab}
        columns = {"o_proj": heads, "down_proj": mlp}
        if kind in rows:
            start, count, full = rows[kind]
            return 0, start, start + count, full
        if kind in columns and is_weight:  # a row-parallel bias is added once, after the sum
            start, count, full = columns[kind]
            return 1, start, start + count, full
        return None
