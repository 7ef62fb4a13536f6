"""Compiles every Triton kernel for Hopper (sm_90) without a GPU, using Triton's bundled
ptxas, and checks each fits in shared memory. Run by ``test_triton_compile.py`` in a fresh
process (the interpreter must be off), or directly: ``python tests/ops/sm90_compile.py``.

Arguments are marked 16-divisible, as Triton's launcher marks real strides and pointers,
so the loads vectorise and the pipeliner runs as it will on the GPU.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.ops import triton_attention as ta
from pdserve.ops import triton_fused as tf
from pdserve.ops import triton_gemv as tg

HOPPER = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024
# Small ints that are not 16-divisible in practice (head counts, row lengths, offsets).
PLAIN_INTS = {"first_seq", "num_heads", "num_kv_heads", "hidden", "head_dim", "inter",
              "num_q_heads", "q_blocks", "M", "split_cap", "balance_programs"}


def compile_kernel(kernel, dtype: str, constexprs: dict, num_warps: int, num_stages: int):
    if "PDL" in kernel.arg_names:  # launched without programmatic dependent launch unless named
        constexprs = {"PDL": False, **constexprs}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _pointer_type(name, dtype)
        elif name in ("qk_scale", "eps"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name].startswith("*") or (signature[name] == "i32" and name not in PLAIN_INTS)
    }
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=HOPPER, options=options)


def _pointer_type(name: str, dtype: str) -> str:
    if name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "arrivals_ptr",
                "used_splits_ptr"):
        return "*i32"
    if name in ("slot_ptr", "positions_ptr", "best_index_ptr", "tokens_ptr"):
        return "*i64"
    if name in ("mid_o_ptr", "mid_lse_ptr", "cos_sin_ptr", "values_ptr", "noise_ptr",
                "best_key_ptr"):
        return "*fp32"
    return "*" + dtype


def attention_cases(dtype: str):
    cuda = torch.device("cuda")
    for head_dim in (64, 128, 256):
        ext = ta.default_extend_config(head_dim, cuda, hopper=True)
        # Plain and GQA-packed rows, the output stored directly or as split partials.
        for row_heads, splits in ((1, 1), (8, 1), (8, 4)):
            yield ta._extend_kernel, dtype, dict(
                GROUP=8, ROW_HEADS=row_heads, HEAD_DIM=head_dim, BLOCK_M=ext.block_m,
                BLOCK_N=ext.block_n, KV_SPLITS=splits,
            ), ext.num_warps, ext.num_stages  # fmt: skip
        yield ta._extend_merge_kernel, dtype, dict(
            HEAD_DIM=head_dim, BLOCK_T=ta._MERGE_TOKENS, KV_SPLITS=16), 4, 1
        dec = ta.default_decode_config(head_dim, cuda)
        # One split writes the output itself; several merge in the same launch or in a second;
        # with the rotary + K/V store fused in or not; long contexts balanced or not.
        for splits, one_launch, fuse_rope, balance in (
                (32, True, False, False), (32, False, False, False), (1, False, False, False),
                (32, True, True, False), (32, False, True, False), (8, False, True, True),
                (8, True, True, True)):
            yield ta._decode_split_kernel, dtype, dict(
                GROUP=8, BLOCK_H=16, ROWS=8, HEAD_DIM=head_dim, BLOCK_N=dec.block_n,
                NUM_SPLITS=splits, MIN_SPLIT_TOKENS=64, BALANCE=balance, BALANCE_WIDTH=64,
                ONE_LAUNCH=one_launch,
                MERGE_SPLITS=ta._merge_splits(splits, 8, head_dim), FUSE_ROPE=fuse_rope,
                HALF_ROT=head_dim // 2 if fuse_rope else 0,
            ), dec.num_warps, dec.num_stages  # fmt: skip
        yield ta._decode_reduce_kernel, dtype, dict(NUM_SPLITS=32, HEAD_DIM=head_dim), 4, 2


def fused_cases(dtype: str):
    yield tf._rms_norm_kernel, dtype, dict(HAS_RESIDUAL=True, BLOCK=8192), 16, 1
    yield tf._silu_and_mul_kernel, dtype, dict(BLOCK=1024), 4, 1
    yield tf._rope_kernel, dtype, dict(HALF_ROT=32, BLOCK_H=16, BLOCK_HALF=32, BLOCK_PASS=64), 4, 1
    yield tf._store_kv_kernel, dtype, dict(BLOCK_H=8, HEAD_DIM=128), 4, 1
    for half_rot, block_pass in ((64, 0), (32, 64)):  # full and partial rotary
        yield tf._rope_store_kv_kernel, dtype, dict(
            HALF_ROT=half_rot, HEAD_DIM=128, BLOCK_HQ=16, BLOCK_HKV=8, BLOCK_HALF=half_rot,
            BLOCK_PASS=block_pass, BLOCK_D=128,
        ), 4, 1  # fmt: skip


def gemv_cases(dtype: str):
    """The decode GEMV's default configs (one per row bucket) and the tuned table's, with
    each prologue; bias and residual on, as the heaviest variants."""
    configs = [(bucket, tg.default_config(bucket)) for bucket in (1, 2, 4, 8)]
    configs += [(bucket, config) for (_, _, bucket), config in tg.GEMV_CONFIGS.items()]
    # The tensor-core form pads every bucket to 16 rows: one compile per config.
    launches = {(16 if config.use_dot else bucket, config) for bucket, config in configs}
    for block_m, config in sorted(launches, key=str):
        for prologue in (0, 1, 2):
            yield tg._gemv_kernel, dtype, dict(
                PROLOGUE=prologue, HAS_BIAS=True, HAS_RESIDUAL=prologue != 1,
                USE_DOT=config.use_dot, DOT_PRECISION="tf32", BLOCK_M=block_m,
                BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            ), config.num_warps, config.num_stages  # fmt: skip


def pdl_cases(dtype: str):
    """Each kernel the decode path launches with ``PDSERVE_PDL=1``, compiled with its wait."""
    for kernel, dt, constexprs, warps, stages in (*attention_cases(dtype), *fused_cases(dtype)):
        if "PDL" in kernel.arg_names and "PDL" not in constexprs:
            yield kernel, dt, {**constexprs, "PDL": True}, warps, stages


def check_pdl(dtype: str) -> None:
    """With PDL the kernel waits on the grid before it (``griddepcontrol.wait``) and
    without it does not: the constexpr reaches the PTX."""
    names = set()
    for kernel, dt, constexprs, warps, stages in pdl_cases(dtype):
        if kernel.__name__ in names:
            continue  # one variant each is enough to see the wait
        names.add(kernel.__name__)
        with_wait = compile_kernel(kernel, dt, constexprs, warps, stages).asm["ptx"]
        without = compile_kernel(kernel, dt, {**constexprs, "PDL": False}, warps,
                                 stages).asm["ptx"]
        for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            assert instruction in with_wait, (kernel.__name__, instruction)
            assert instruction not in without, (kernel.__name__, instruction)
        print(f"{kernel.__name__} {dt}: griddepcontrol.wait with PDL only", flush=True)
    expected = {"_decode_split_kernel", "_decode_reduce_kernel", "_rms_norm_kernel",
                "_silu_and_mul_kernel", "_rope_store_kv_kernel"}
    assert names == expected, names


def main(dtypes: list[str]) -> None:
    for dtype in dtypes:
        cases = [*attention_cases(dtype), *fused_cases(dtype),
                 *gemv_cases(dtype)]
        for kernel, dt, constexprs, warps, stages in cases:
            compiled = compile_kernel(kernel, dt, constexprs, warps, stages)
            shared = compiled.metadata.shared
            print(f"{kernel.__name__} {dt} {constexprs} warps={warps} stages={stages} "
                  f"shared={shared}", flush=True)  # fmt: skip
            assert shared <= MAX_SHARED, f"{kernel.__name__} needs {shared} B of shared memory"
        check_pdl(dtype)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16"])
