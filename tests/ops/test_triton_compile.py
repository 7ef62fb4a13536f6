"""The Triton kernels compile for the H200 (sm_90) even on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_env import HAS_TRITON

OPT_IN = "PDSERVE_SM90_COMPILE"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(
    os.environ.get(OPT_IN) != "1", reason=f"set {OPT_IN}=1 to compile for sm_90 (about a minute)"
)
def test_kernels_compile_for_sm90():
    script = Path(__file__).with_name("sm90_compile.py")
    repo_root = Path(__file__).resolve().parents[2]
    # A fresh process: with the interpreter on, the kernels are not compilable objects.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, str(script), "bf16", "fp16"], check=True, env=env, timeout=600)
