"""attention_stats kernel vs the PyTorch path vs eager softmax-with-weights vs an SDPA (flash) forward,
and what a probe's attention costs on GPU either way: the model's own flash attention beside the
statistics kernel (the default) or the fused Triton kernel giving the output and the lse, the
statistics read off it (``SINKWATCH_ATTENTION_OUTPUT=fused``): ``fused_over_default_time``.

Same q/k/v, causal, bfloat16, B=1, heads x head_dim = 2048 (so D=64 has 32 heads, D=256 has 8),
S from 512 to 8192. Reports time (median of CUDA-event timings) and peak memory above the inputs,
with ratios side by side, and writes a CSV. On a machine without CUDA it times the PyTorch path
only (float32, CPU), at the sizes given.

Before timing, each backend is checked against the float64 reference on a small shape: a broken
kernel is not benchmarked.

Usage: python benchmarks/bench_attention_stats.py [--seq 512 1024 ...] [--dims 64 128 256] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_csv  # noqa: E402
from kernel_cases import assert_close_to_reference, make_inputs  # noqa: E402

from sinkwatch import attention_stats  # noqa: E402
from sinkwatch.kernels import attention_output  # noqa: E402


def check_backends(device: str, backends: list[str]) -> None:
    q, k = make_inputs(1, 4, 2, 200, 64, dtype=torch.bfloat16 if device == "cuda" else torch.float32, seed=0, device=device)
    rows = torch.tensor([[199, 3, 150]], device=device)
    cols = torch.tensor([[[0, 1, 198], [0, 5, -1], [0, 149, 151]]], device=device)
    ref = attention_stats(q.cpu(), k.cpu(), 0.125, rows=rows.cpu(), cols=cols.cpu(), backend="reference")
    for b in backends:
        assert_close_to_reference(attention_stats(q, k, 0.125, rows=rows, cols=cols, backend=b), ref)
    if "triton" in backends:  # the fused kernel, and statistics read off its lse
        fused = attention_output(q, k, make_inputs(1, 2, 2, 200, 64, dtype=q.dtype, seed=3, device=device)[0], 0.125, backend="triton")
        assert fused.backend == "triton", "the fused Triton kernel fell back to the PyTorch path (see the warning above)"
        assert_close_to_reference(attention_stats(q, k, 0.125, rows=rows, cols=cols, fused=fused, backend="triton"), ref)
    print(f"correctness check passed for {', '.join(backends)} on {device}", file=sys.stderr)


def timed(fn, device: str, repeat: int) -> tuple[float, float]:
    """(median seconds, peak MiB above what was allocated before)."""
    if device == "cuda":
        torch.cuda.synchronize()
        fn()  # warm-up / autotune
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
            del out
        return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times), float("nan")


def methods(q, k, v, scale, device):
    import torch.nn.functional as F

    def eager():
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        w = torch.softmax(s.masked_fill_(mask, float("-inf")), dim=-1)
        return torch.matmul(w, v), w

    def sdpa_flash():
        if device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    out = {
        "triton": lambda: attention_stats(q, k, scale, backend="triton"),
        "torch_path": lambda: attention_stats(q, k, scale, backend="torch"),
        "triton_last_row": lambda: attention_stats(
            q, k, scale, rows=torch.full((q.shape[0], 1), q.shape[2] - 1, device=q.device), backend="triton"
        ),
        "eager_weights": eager,
        "sdpa_flash": sdpa_flash,
        # a probe's attention on GPU: the default, and the fused kernel (entropy unused, as SinkPart asks)
        "default_sdpa_plus_stats": lambda: (sdpa_flash(), attention_stats(q, k, scale, backend="triton", entropy=False)),
        "fused_triton": lambda: attention_stats(q, k, scale, fused=attention_output(q, k, v, scale, backend="triton"), entropy=False),
    }
    if device != "cuda":
        out = {"torch_path": out["torch_path"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192] if cuda else [512, 1024, 2048])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--width", type=int, default=2048, help="heads x head_dim")
    ap.add_argument("--repeat", type=int, default=10 if cuda else 3)
    ap.add_argument("--csv", default="benchmarks/results/bench_attention_stats.csv")
    args = ap.parse_args()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    check_backends(device, ["triton", "torch"] if cuda else ["torch"])

    rows = []
    for D in args.dims:
        H = max(1, args.width // D)
        for S in args.seq:
            q, k = make_inputs(1, H, H, S, D, dtype=dtype, seed=1, device=device)
            v = make_inputs(1, H, H, S, D, dtype=dtype, seed=2, device=device)[0]
            res = {}
            for name, fn in methods(q, k, v, D**-0.5, device).items():
                try:
                    res[name] = timed(fn, device, args.repeat)
                except torch.OutOfMemoryError:
                    res[name] = (float("nan"), float("nan"))
                    torch.cuda.empty_cache()
            row = {"device": device, "dtype": str(dtype).split(".")[-1], "S": S, "D": D, "H": H}
            for name, (t, m) in res.items():
                row[f"{name}_ms"] = t * 1000
                row[f"{name}_mib"] = m
            if cuda:
                row["eager_over_triton_time"] = res["eager_weights"][0] / res["triton"][0]
                row["triton_over_sdpa_time"] = res["triton"][0] / res["sdpa_flash"][0]
                row["torch_over_triton_time"] = res["torch_path"][0] / res["triton"][0]
                row["eager_over_triton_mem"] = res["eager_weights"][1] / max(res["triton"][1], 1e-9)
                row["fused_over_default_time"] = res["fused_triton"][0] / res["default_sdpa_plus_stats"][0]
            rows.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    if cuda:
        print("\n  D     S |  triton ms  sdpa ms  eager ms  torch ms | eager/triton  triton/sdpa | triton MiB  eager MiB | fused/default")
        for r in rows:
            print(
                f"{r['D']:>3} {r['S']:>5} | {r['triton_ms']:9.3f} {r['sdpa_flash_ms']:8.3f} "
                f"{r['eager_weights_ms']:9.3f} {r['torch_path_ms']:9.3f} | "
                f"{r['eager_over_triton_time']:12.1f} {r['triton_over_sdpa_time']:12.2f} | "
                f"{r['triton_mib']:10.1f} {r['eager_weights_mib']:10.1f} | {r['fused_over_default_time']:13.2f}"
            )
    print(f"CSV: {write_csv(rows, args.csv)}")


if __name__ == "__main__":
    main()
