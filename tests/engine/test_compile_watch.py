"""Kernels compiled after start-up are counted by name, and the engine says so."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.engine.compile_watch import EXAMPLES, CompileWatch
from pdserve.engine.llm import LLM


def _compiled(watch: CompileWatch, name: str, splits: int) -> None:
    """As Triton calls its post-compile hook."""
    watch(key=("k",), repr=name, fn=SimpleNamespace(module="m", name=name),
          compile={"constants": {"NUM_SPLITS": splits}}, is_manual_warmup=False,
          already_compiled=False)


def test_compiles_count_only_once_serving_and_chain_the_previous_hook():
    seen = []
    watch = CompileWatch()
    watch.installed, watch._previous = True, lambda **kw: seen.append(kw["repr"])
    _compiled(watch, "_decode_kernel", 32)  # the warm-up's: expected
    watch.serving()
    for splits in (8, 4, 2, 1):
        _compiled(watch, "_decode_kernel", splits)
    _compiled(watch, "_extend_kernel", 1)
    described = watch.describe()
    assert described["compiles"] == 5
    assert described["by_kernel"] == {"_decode_kernel": 4, "_extend_kernel": 1}
    assert len(described["constants"]["_decode_kernel"]) == EXAMPLES
    assert "'NUM_SPLITS': 8" in described["constants"]["_decode_kernel"][0]
    assert len(seen) == 6  # every compile reached the hook that was there before


def test_on_the_cpu_nothing_is_watched_and_the_engine_says_why():
    info = LLM("tiny", device="cpu").engine.describe()["kernels_compiled_while_serving"]
    assert info == {"watched": False, "why": "not on a CUDA device"}


def test_install_hooks_triton_s_post_compile_callback_where_it_has_one():
    watch = CompileWatch()
    try:
        from triton import knobs
    except ImportError:
        assert not watch.install() and "no knobs" in watch.describe()["why"]
        return
    before = knobs.runtime.jit_post_compile_hook
    try:
        assert watch.install() and watch.install()  # a second call changes nothing
        assert knobs.runtime.jit_post_compile_hook is watch
        assert watch._previous is before
        assert watch.describe() == {"watched": True, "compiles": 0, "by_kernel": {},
                                    "constants": {}}
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_a_compile_names_its_integer_arguments_specialisation():
    # Two compiles with the same constants differ in which integers are multiples of 16.
    watch = CompileWatch()
    watch.installed = True
    watch.serving()
    watch(key=("k",), repr="_decode_kernel[num_warps=4, num_ctas=1](q_ptr: *fp16, "
          "stride_bt: i32D, page_size: i32, scale: fp32, NUM_SPLITS: constexpr)",
          fn=SimpleNamespace(module="m", name="_decode_kernel"),
          compile={"constants": {"NUM_SPLITS": 4}}, is_manual_warmup=False,
          already_compiled=False)
    example = watch.describe()["constants"]["_decode_kernel"][0]
    assert example == "{'NUM_SPLITS': 4} stride_bt: i32D, page_size: i32"


def test_the_specialisation_reads_either_way_triton_writes_argument_types():
    from pdserve.engine.compile_watch import specialised_integers
    joined = "_k[num_warps=4](q: *bf16D, stride_bt: i32D, page: i32, scale: fp32, N: constexpr)"
    paired = ("_k[num_warps=4](q: ('*bf16', 'D'), stride_bt: ('i32', 'D'), page: ('i32', ''), "
              "scale: ('fp32', ''), N: ('constexpr', 4))")
    assert specialised_integers(joined) == specialised_integers(paired) == \
        "stride_bt: i32D, page: i32"
