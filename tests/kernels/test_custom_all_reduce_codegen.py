"""The fused all-reduce kernels move 16 bytes a thread on the peers' buffers, compiled for an H100.

The symmetric buffers' addresses come from a table of int64s, which carries no alignment Triton
can see: without `_buffer`'s hint every load and store of a buffer compiles to 2 bytes a thread
(2.4x slower over NVLink at 256 rows, docs/benchmarks.md "All-reduce latency"). Compiling needs
no GPU, only Triton's compiler, in a process without the interpreter the tests run kernels in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import collections, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from minivllm.kernels import custom_all_reduce

kernel = getattr(custom_all_reduce, sys.argv[1])
types = {"rows": "i32", "eps": "fp32", "buffer_ptrs": "*i64", "signal_pad_ptrs": "*i64"}
constants = {"RANK": 0, "WORLD": 2, "N": 4096, "BLOCK": 4096}
args = [name for name in kernel.arg_names if name not in constants]
signature = {name: types.get(name, "i32" if name.startswith("stride") else "*bf16") for name in args}
# What a launch specializes: 16-byte aligned tensors, strides that are multiples of 16.
aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
           for name in args if signature[name].startswith("*") or name.startswith("stride")}
source = triton.compiler.ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                                   constexprs=constants, attrs=aligned)
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(json.dumps(collections.Counter(re.findall(r"\b(?:ld|st)(?:\.volatile)?\.global\.[a-z0-9.]+", ptx))))
"""


@pytest.mark.parametrize("kernel", ["_one_shot_kernel", "_two_shot_kernel"])
def test_every_global_bf16_access_moves_16_bytes(kernel):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, kernel], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    accesses = json.loads(done.stdout.strip().splitlines()[-1])
    narrow = {op: n for op, n in accesses.items() if op.endswith(".b16")}
    assert not narrow, f"2-byte global loads or stores in {kernel}: {narrow}"
    assert accesses.get("ld.volatile.global.v4.b32", 0) > 0  # the peers' rows, read 16 bytes a thread
    assert accesses.get("st.global.v4.b32", 0) > 0
