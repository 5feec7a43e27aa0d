#!/usr/bin/env python
"""Which operations' bits change with the intra-op thread count, or with the CPU code path.

    python -m tools.diagnose.determinism_table                 # markdown table on stdout
    python -m tools.diagnose.determinism_table --json t.json   # and the raw figures

Each *setting* is one child process that computes every operation of ``OPERATIONS`` on the
same inputs and saves the outputs (forward values and gradients). The inputs are drawn
once, here, and handed to every child: ``torch.randn`` itself gives other bits under
another CPU capability (its own row of the table), which would hide what the operations do.

    threads=1, threads=2, threads=4        torch.set_num_threads(n), everything else as is
    isa=default                            ATEN_CPU_CAPABILITY=default: torch's own kernels
                                           without AVX2 vectorisation (stands in for a CPU
                                           whose vector unit differs)
    mkl=sse4_2                             MKL_ENABLE_INSTRUCTIONS=SSE4_2: MKL's GEMM takes
                                           another code path (stands in for another vendor's
                                           BLAS dispatch; MKL picks its kernels by CPU)

Every setting is compared with threads=1: "same" means every output is bit-identical
(``torch.equal``); otherwise the cell names the outputs that differ ("grad weight") and the
largest relative difference among them, max|a-b| / max|a|. Shapes are those of the
default zero-train GPT (B=8, T=128, C=128, vocabulary 256) and of a GPT-2-small layer
(B=2, T=256, C=768, vocabulary 50304), because whether an operation splits its work
across threads depends on its size (ATen's grain sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

SHAPES = {
    "small": {"B": 8, "T": 128, "C": 128, "V": 256, "H": 4},
    "gpt2": {"B": 2, "T": 256, "C": 768, "V": 50304, "H": 12},
}
SETTINGS: dict[str, tuple[int, dict[str, str]]] = {
    "threads=1": (1, {}),
    "threads=2": (2, {}),
    "threads=4": (4, {}),
    "isa=default": (1, {"ATEN_CPU_CAPABILITY": "default"}),
    "mkl=sse4_2": (1, {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
}
REFERENCE = "threads=1"

Outputs = dict[str, torch.Tensor]


def _inputs(shape: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, c, v = shape["B"], shape["T"], shape["C"], shape["V"]
    return {
        "x": torch.randn(b, t, c, generator=g),
        "w": torch.randn(4 * c, c, generator=g) / c**0.5,
        "bias": torch.randn(4 * c, generator=g),
        "ln_w": torch.rand(c, generator=g) + 0.5,
        "ln_b": torch.randn(c, generator=g),
        "tokens": torch.randint(0, v, (b, t), generator=g),
        "table": torch.randn(v, c, generator=g),
        "logits": torch.randn(b * t, v, generator=g),
    }


def _uniform(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Values in [-1, 1) drawn in a child: torch.rand gives the same bits on every ISA,
    torch.randn does not (see its row)."""
    return torch.rand(shape, generator=generator) * 2 - 1


def _with_grads(fn: Callable[..., torch.Tensor], **args: torch.Tensor) -> Outputs:
    """The forward value and the gradient of each named input ("grad x", "grad weight")."""
    leaves = {k: a.detach().clone().requires_grad_(a.is_floating_point()) for k, a in args.items()}
    out = fn(*leaves.values())
    g = torch.Generator().manual_seed(1)
    out.backward(_uniform(out.shape, g).to(out.dtype))
    result = {"forward": out.detach()}
    for name, leaf in leaves.items():
        if leaf.grad is not None:
            result[f"grad {name}"] = leaf.grad
    return result


def op_linear(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    return _with_grads(F.linear, x=i["x"], weight=i["w"], bias=i["bias"])


def op_linear_bf16(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    bf = torch.bfloat16
    out = _with_grads(F.linear, x=i["x"].to(bf), weight=i["w"].to(bf), bias=i["bias"].to(bf))
    return {k: v.float() for k, v in out.items()}


def op_layer_norm(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (s["C"],), w, b)

    return _with_grads(norm, x=i["x"], weight=i["ln_w"], bias=i["ln_b"])


def op_softmax(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    return _with_grads(lambda x: torch.softmax(x, dim=-1), x=i["logits"])


def op_attention(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    b, t, c, h = s["B"], s["T"], s["C"], s["H"]

    def attend(x: torch.Tensor) -> torch.Tensor:
        q = x.view(b, t, h, c // h).transpose(1, 2)  # (B, nh, T, hs)
        return F.scaled_dot_product_attention(q, q * 0.5, q.flip(-1), is_causal=True)

    return _with_grads(attend, x=i["x"])


def op_embedding(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    tokens = i["tokens"]
    return _with_grads(lambda table: F.embedding(tokens, table), table=i["table"])


def op_cross_entropy(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    targets = i["tokens"].reshape(-1)
    return _with_grads(lambda z: F.cross_entropy(z, targets), logits=i["logits"])


def op_randn(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    """What a model's initialisation draws (normal_ is randn's kernel)."""
    g = torch.Generator().manual_seed(0)
    return {"values": torch.randn(s["V"], s["C"], generator=g)}


def op_sum(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
    logits = i["logits"]
    return {"sum": logits.sum().reshape(1), "sum of squares": logits.square().sum().reshape(1)}


def _adamw(variant: str) -> Callable[[dict[str, torch.Tensor], dict[str, int]], Outputs]:
    def run(i: dict[str, torch.Tensor], s: dict[str, int]) -> Outputs:
        params = [i["w"].clone().requires_grad_(), i["table"].clone().requires_grad_()]
        kwargs = {"foreach": False, "fused": False}
        if variant != "for-loop":
            kwargs = {"foreach": variant == "foreach", "fused": variant == "fused"}
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            for p in params:
                p.grad = _uniform(p.shape, g)
            opt.step()
        return {"weight": params[0].detach(), "table": params[1].detach()}

    return run


OPERATIONS: dict[str, Callable[[dict[str, torch.Tensor], dict[str, int]], Outputs]] = {
    "randn / normal_ (initial weights)": op_randn,
    "linear fwd+bwd (fp32)": op_linear,
    "linear fwd+bwd (bf16)": op_linear_bf16,
    "layer norm fwd+bwd": op_layer_norm,
    "softmax fwd+bwd": op_softmax,
    "attention (SDPA) fwd+bwd": op_attention,
    "embedding bwd": op_embedding,
    "cross-entropy fwd+bwd": op_cross_entropy,
    "sum (a full reduction)": op_sum,
    "AdamW for-loop": _adamw("for-loop"),
    "AdamW foreach": _adamw("foreach"),
    "AdamW fused": _adamw("fused"),
}


def child(inputs_file: Path, out: Path, threads: int) -> None:
    torch.set_num_threads(threads)
    all_inputs: dict[str, dict[str, torch.Tensor]] = torch.load(inputs_file)
    results: dict[str, Outputs] = {}
    for size, shape in SHAPES.items():
        inputs = all_inputs[size]
        for name, op in OPERATIONS.items():
            results[f"{size}|{name}"] = op(inputs, shape)
    torch.save(results, out)


def run_setting(name: str, folder: Path) -> dict[str, Outputs]:
    threads, extra_env = SETTINGS[name]
    out = folder / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(extra_env)
    command = [sys.executable, __file__, "--child", str(out), "--threads", str(threads),
               "--inputs", str(folder / "inputs.pt")]  # fmt: skip
    subprocess.run(command, env=env, check=True, timeout=900)
    loaded: dict[str, Outputs] = torch.load(out)
    return loaded


def differences(a: Outputs, b: Outputs) -> dict[str, float]:
    """Each output that is not bit-identical, with max|a-b| / max|a| (at least 1e-30)."""
    found = {}
    for key in a:
        if not torch.equal(a[key], b[key]):
            scale = float(a[key].abs().max()) or 1.0
            found[key] = max(float((a[key] - b[key]).abs().max()) / scale, 1e-30)
    return found


def cell(found: dict[str, float]) -> str:
    if not found:
        return "same"
    return ", ".join(found) + f" ({max(found.values()):.0e})"


Figures = dict[str, dict[str, dict[str, float]]]


def table(results: dict[str, dict[str, Outputs]]) -> tuple[list[str], Figures]:
    """Markdown rows, one per (operation, shape): which outputs differ from the reference."""
    others = [s for s in SETTINGS if s != REFERENCE]
    figures: Figures = {}
    for key in results[REFERENCE]:
        figures[key] = {s: differences(results[REFERENCE][key], results[s][key]) for s in others}
    lines = [
        "| operation | shape | " + " | ".join(f"{s} vs {REFERENCE}" for s in others) + " |",
        "|---|---|" + "---|" * len(others),
    ]
    for key, row in figures.items():
        size, name = key.split("|")
        cells = [cell(row[s]) for s in others]
        lines.append(f"| {name} | {size} | " + " | ".join(cells) + " |")
    return lines, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if args.child is not None:
        child(args.inputs, args.child, args.threads)
        return
    with tempfile.TemporaryDirectory(prefix="determinism-") as tmp:
        torch.save(
            {size: _inputs(shape) for size, shape in SHAPES.items()}, Path(tmp) / "inputs.pt"
        )
        results = {name: run_setting(name, Path(tmp)) for name in SETTINGS}
    lines, figures = table(results)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
