"""Compile the Triton kernel ahead of time for a GPU architecture, on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs the kernel's Python semantics but none of the GPU
compiler: it accepts code the compiler rejects (a non-constexpr global, a bad ``tl.dot`` shape) and
says nothing about registers or shared memory. Triton ships ``ptxas`` and ``cuobjdump``, so the
real pipeline (TTIR → TTGIR → LLVM → PTX → cubin) runs on any CPU. This module compiles every
autotune config for a target and reads back what the hardware would be asked for:

    registers per thread, spilled bytes per thread (STACK + LOCAL), shared memory per program

Used by ``tests/test_kernels_triton_compile.py`` and ``benchmarks/bench_kernel_resources.py``.
Run it in a process where ``TRITON_INTERPRET`` is unset: ``triton.jit`` picks interpreter or
compiler when the kernel is defined, so the CLI re-executes itself without the variable.

    python -m sinkwatch.kernels.triton_aot [--arch 90 80] [--head-dims 64 128 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# Shared memory a single program may use (opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


@dataclass(frozen=True)
class Variant:
    """The specialisation of one launch: what ``attention_stats_triton`` would pass as constexprs."""

    dtype: str = "bf16"  # bf16 | fp16 | fp32
    head_dim: int = 128
    n_first: int = 8
    rows: bool = False  # a subset of query rows (the paper's protocol: one row per sequence)
    window: bool = False
    softcap: bool = False


@dataclass(frozen=True)
class Resources:
    arch: int
    dtype: str
    head_dim: int
    variant: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_bytes: int  # per thread (STACK + LOCAL): 0 means nothing left registers
    shared_bytes: int  # per program

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_LIMIT.get(self.arch, 48 * 1024)

    def as_row(self) -> dict:
        """Every field and ``fits``: one CSV row or JSON line."""
        return asdict(self) | {"fits": self.fits}


def compiler_env() -> dict[str, str]:
    """This process's environment without ``TRITON_INTERPRET``: for a child that must compile."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _jit_function():
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError(
            "ahead-of-time compilation needs the compiler, but TRITON_INTERPRET=1 made triton.jit build "
            "interpreted functions; run `python -m sinkwatch.kernels.triton_aot` (it drops the variable)"
        )
    from triton.runtime.jit import JITFunction

    from .triton_stats import _attention_stats_kernel

    fn = _attention_stats_kernel
    while not isinstance(fn, JITFunction):  # unwrap the autotuner
        fn = fn.fn
    return fn


def _launch_constexprs(v: Variant, block_m: int, block_n: int) -> dict:
    from .triton_stats import specialisation

    return dict(
        **specialisation(
            head_dim=v.head_dim, n_first=v.n_first, rows=v.rows, window=v.window, softcap=v.softcap,
            float32=v.dtype == "fp32", interpret=False,
        ),
        BLOCK_M=block_m, BLOCK_N=block_n,
        # the runtime specialises integer arguments equal to 1 into constants; a contiguous last
        # dimension (the usual case) makes these two unit strides, and the loads vectorise
        sq_d=1, sk_d=1,
    )


def _signature(fn, constexprs: dict, dtype: str) -> tuple[dict, dict]:
    """Argument types, and the divisibility hints the runtime would find for contiguous inputs."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("q_ptr", "k_ptr"):
            sig[name] = _DTYPES[dtype]
        elif name in ("rows_ptr", "cols_ptr"):
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name in ("scaling", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name in ("sq_b", "sq_h", "sq_s", "sk_b", "sk_h", "sk_s"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # 16-byte aligned pointers, strides of 16k elements
    return sig, attrs


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers, spilled bytes, static shared bytes) from ``cuobjdump --dump-resource-usage``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", text))
    if "REG" not in fields:
        raise RuntimeError(f"could not read resource usage from cuobjdump output:\n{text}")
    return int(fields["REG"]), int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)), int(fields.get("SHARED", 0))


def compile_config(arch: int, variant: Variant, config) -> Resources:
    """Compile one autotune ``triton.Config`` for ``sm_<arch>`` and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function()
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    constexprs = _launch_constexprs(variant, bm, bn)
    sig, attrs = _signature(fn, constexprs, variant.dtype)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    regs, spill, static_shared = _resource_usage(kernel.asm["cubin"])
    flags = ",".join(k for k in ("rows", "window", "softcap") if getattr(variant, k)) or "all_rows"
    return Resources(
        arch=arch, dtype=variant.dtype, head_dim=variant.head_dim, variant=flags,
        block_m=bm, block_n=bn, num_warps=config.num_warps, num_stages=config.num_stages,
        registers=regs, spill_bytes=spill, shared_bytes=max(kernel.metadata.shared, static_shared),
    )  # fmt: skip


def autotune_configs(dtype: str):
    """The configs the compiled autotuner times for inputs of ``dtype`` (whatever ``TRITON_INTERPRET`` says)."""
    from .triton_stats import _configs, configs_for

    return configs_for(_configs(interpret=False), float32=dtype == "fp32")


def survey(archs, variants, *, first_config_only: bool = False) -> list[Resources]:
    """Compile every (arch, variant, autotune config); the first config is the largest tile."""
    return [
        compile_config(a, v, c)
        for a in archs
        for v in variants
        for c in autotune_configs(v.dtype)[: 1 if first_config_only else None]
    ]


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sinkwatch.kernels.triton_aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities (90 = H100/H200, 80 = A100)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(_DTYPES))
    p.add_argument("--variants", nargs="+", default=["all_rows"], choices=["all_rows", "rows", "window_softcap"])
    p.add_argument("--first-config", action="store_true", help="only the first (largest) autotune config: a quick compile check")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # re-run with the compiler
        return subprocess.call(
            [sys.executable, "-m", "sinkwatch.kernels.triton_aot", *(argv if argv is not None else sys.argv[1:])], env=compiler_env()
        )
    flags = {"all_rows": {}, "rows": {"rows": True}, "window_softcap": {"window": True, "softcap": True}}
    variants = [Variant(dtype=t, head_dim=d, **flags[f]) for t in args.dtypes for d in args.head_dims for f in args.variants]
    if not args.json:
        print(
            f"{'arch':>4} {'dtype':>5} {'D':>4} {'variant':>14} {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} "
            f"{'regs':>5} {'spill B':>7} {'smem KiB':>8} fits"
        )
    for r in survey(args.arch, variants, first_config_only=args.first_config):
        if args.json:
            print(json.dumps(r.as_row()), flush=True)
        else:
            print(
                f"{r.arch:>4} {r.dtype:>5} {r.head_dim:>4} {r.variant:>14} {r.block_m:>4} {r.block_n:>4} {r.num_warps:>5} "
                f"{r.num_stages:>6} {r.registers:>5} {r.spill_bytes:>7} {r.shared_bytes / 1024:>8.1f} {'yes' if r.fits else 'NO'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
