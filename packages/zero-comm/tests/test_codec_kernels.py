"""ZeRO++'s codec gives the same bytes whichever of torch's CPU kernels run.

Ranks on CPUs of different kinds decode each other's weights (qwZ) and gradients (qgZ), and
torch picks its CPU kernels per instruction set (scalar, AVX2, AVX-512; the environment
variable ATEN_CPU_CAPABILITY caps the choice). The codec is built only from operations
that IEEE arithmetic makes exact: max and min, one division and one multiplication per
value, rounding half to even, clamping and integer conversions. So every kernel set must
give the same wire bytes and the same decoded values, or two such ranks would compute with
different weights. The model's own operations do not have this property (LayerNorm and
reductions differ by kernel set: docs/across-nodes.md, section "The head's own window, and
an AMD machine"); the codec must keep it, and a change that brought in a reduction or a
transcendental function would lose it.

Compared here: torch's scalar kernels against this machine's own (AVX2 or AVX-512), in
fresh processes, on inputs made by numpy (torch's own random numbers differ by kernel set).

One exception, not the codec's: torch's float32 -> bfloat16 cast writes NaN as 0x7fc0
with its scalar kernels and as 0xffff with AVX2 (torch 2.13), so a block decoded into
bfloat16 as NaN (a non-finite input) has NaNs of other bits. Decoded values are compared
with NaNs by place only; the wire and the float32 values bit for bit. Canonicalizing
those NaNs in the decoder would cost two passes over every reduced-precision gather for
values that already stop a step (non-finite).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = r"""
import hashlib
import numpy as np
import torch
from zero_comm import BlockQuantizer

torch.set_num_threads(1)
print(torch.backends.cpu.get_cpu_capability())
rng = np.random.default_rng(2026)

def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def values(n, dtype):
    x = rng.standard_normal(n) * 2.0 ** rng.integers(-30, 12, n)
    x[rng.random(n) < 0.02] = 0.0
    x[rng.random(n) < 0.01] = -0.0
    if n > 300:  # a block of ties: k + 1/2 steps of an exact power-of-two scale
        x[:256] = (rng.integers(-127, 127, 256) + 0.5) * 2.0**-10
        x[0] = 127 * 2.0**-10
        x[256:300] = 0.0  # an all-zero stretch
    for special in (np.nan, np.inf, -np.inf, 1e-40):  # 1e-40: float32 subnormal
        if rng.random() < 0.3:
            x[rng.integers(0, n)] = special
    x32 = x.astype(np.float32)
    if dtype == torch.bfloat16:  # exactly representable, so the cast rounds nothing
        bits = x32.view(np.uint32) & np.uint32(0xFFFF0000)
        x32 = np.where(np.isnan(x32), np.float32(np.nan), bits.view(np.float32))
    if dtype == torch.float16:
        x32 = x32.astype(np.float16).astype(np.float32)
    return torch.from_numpy(x32).to(dtype)

for case in range(48):
    dtype = (torch.float32, torch.bfloat16, torch.float16)[case % 3]
    bits = (8, 4)[case // 3 % 2]
    block = (2048, 128, 38, 2)[case // 6 % 4]
    parts = 1 + case // 24 * int(rng.integers(1, 4))
    n = int(rng.integers(1, 40_000))
    x = values(n * parts, dtype)
    codec = BlockQuantizer(bits, block)
    wire = codec.encode(x, parts)
    out = torch.empty(n * parts, dtype=dtype)
    codec.decode(wire, n, parts, out=out)
    nan = out.isnan()
    out[nan] = 0  # NaNs compared by place: their bfloat16 bits are torch's cast's (below)
    print(case, dtype, bits, block, parts, n, digest(wire), digest(out), digest(nan),
          digest(codec.decode(wire, n, parts)))
"""


def run_cases(capability: str | None) -> tuple[str, list[str]]:
    """The kernel set torch used, and one line of digests per case."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, "-c", CASES], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, *cases = done.stdout.splitlines()
    return first, cases


def test_the_codec_gives_the_same_bytes_under_every_cpu_kernel_set() -> None:
    native_set, native = run_cases(None)
    if native_set == "DEFAULT":
        pytest.skip("torch runs its scalar kernels on this CPU: there is no other set here")
    scalar_set, scalar = run_cases("default")
    assert scalar_set == "DEFAULT", f"ATEN_CPU_CAPABILITY=default ran {scalar_set}"
    assert len(native) == len(scalar) == 48
    differing = [f"{a}  |  {b}" for a, b in zip(native, scalar, strict=True) if a != b]
    assert not differing, (
        f"the codec's bytes differ between torch's {native_set} and scalar kernels in "
        f"{len(differing)} of 48 cases (case dtype bits block parts n: wire, decoded into "
        "the dtype, decoded in float32):\n" + "\n".join(differing[:6])
    )
