"""Skinny kernel timing on a GPU against torch's int4 tinygemm, torch bf16 matmul and (M > 5) the Triton kernel and
what `auto` picks.

Protocol of the bench (w4a16.bench.timing): each op is captured many times in a CUDA graph over a rotation of weight copies whose total
size is >= 4x the L2, so weights come from DRAM; per-call time = graph replay time / calls (median of replays).
Copy bandwidth is measured in the same run (bytes read + written). Usage: python tests/csrc/bench_skinny.py [json]

    python tests/csrc/bench_skinny.py --clusters    # each cluster size forced (1, 2, 4 blocks), M = 1 and 5

The second form checks what the launcher's rule (cluster_size_for in csrc/skinny_kernel.cu) picks against every size
it could have picked, on the same layers and with the same timer.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

import w4a16
from w4a16 import skinny

SHAPES = {
    "llama3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
}
GROUP = 128
MIN_CALLS = 48
# M above this also times the Triton kernel: the crossover behind w4a16/dispatch_rules.json.
TRITON_FROM_M = 5


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-4 * l2 // nbytes))


def time_per_call(calls) -> float:
    """Median µs per call of a CUDA graph replaying `calls` (a list of zero-argument callables) in order."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    # Eager, timed with events: inside a graph a plain copy becomes a copy-engine memcpy node, which is slower
    # than the SM copy kernels and is not the ceiling a kernel competes with.
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * a.numel() / statistics.median(times[2:])


def weight_rotation(n: int, k: int, gen: torch.Generator) -> tuple[list, list]:
    """Distinct bf16 uint4b8 weights of >= 4x the L2 in all, and the order a graph of >= MIN_CALLS calls uses them."""
    qws = []
    for _ in range(copies_for(n * k // 2 + n * (k // GROUP) * 2)):
        q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
        s = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
        qws.append(w4a16.QuantizedWeight(w4a16.pack_int4(q), s, None, GROUP))
    return qws, [qws[i % len(qws)] for i in range(len(qws) * -(-MIN_CALLS // len(qws)))]


def bench_shape(n: int, k: int, m: int, gen: torch.Generator) -> dict:
    dtype = torch.bfloat16
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    weight_bytes = n * k // 2 + n * (k // GROUP) * 2
    qws, ours = weight_rotation(n, k, gen)
    copies = len(qws)
    reps = len(ours) // copies
    result = {"n": n, "k": k, "m": m, "bytes": weight_bytes + 2 * m * (k + n), "copies": copies}
    result["skinny_us"] = time_per_call([lambda qw=qw: skinny.skinny_gemm(x, qw) for qw in ours])
    if m > TRITON_FROM_M:  # past the rows "auto" sent to the skinny kernel: the Triton kernel is the alternative
        from w4a16.triton import triton_gemm

        result["triton_us"] = time_per_call([lambda qw=qw: triton_gemm(x, qw) for qw in ours])
        # What "auto" picks here (w4a16/dispatch_rules.json may send a shape to Triton below the row limit).
        result["auto"] = w4a16.dispatch.choose_backend(m, n, k, dtype, x.device)
        result["auto_us"] = time_per_call([lambda qw=qw: w4a16.gemm(x, qw) for qw in ours])
    del qws
    try:
        packs = []
        for _ in range(copies):
            raw = torch.randint(0, 256, (n, k // 2), device="cuda", generator=gen, dtype=torch.uint8)
            packs.append(torch.ops.aten._convert_weight_to_int4pack(raw, 8))
        sz = (torch.rand(k // GROUP, n, 2, device="cuda", generator=gen) * 0.01).to(dtype)
        calls = [lambda p=packs[i % copies]: torch.ops.aten._weight_int4pack_mm(x, p, GROUP, sz)
                 for i in range(copies * reps)]
        result["tinygemm_us"] = time_per_call(calls)
        del packs
    except Exception as exc:  # report, keep the rest of the table
        result["tinygemm_error"] = f"{type(exc).__name__}: {exc}"[:200]
    dense_copies = max(2, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // (n * k * 2)))
    dense = [torch.randn(n, k, device="cuda", generator=gen).to(dtype) for _ in range(dense_copies)]
    dreps = -(-MIN_CALLS // dense_copies)
    result["bf16_us"] = time_per_call([lambda w=dense[i % dense_copies]: torch.nn.functional.linear(x, w)
                                       for i in range(dense_copies * dreps)])
    return result


def time_cluster_sizes(gen: torch.Generator) -> None:
    """µs of each forced cluster size and of the launcher's own pick, every output checked against one block's."""
    sizes = (1, 2, 4)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; bf16, uint4b8 G={GROUP}; µs per call")
    print(f"{'model':12s} {'layer':8s} {'M':>2s} " + " ".join(f"{f'{c} block' + 's' * (c > 1):>9s}" for c in sizes)
          + f" {'chosen':>9s}")
    for model, layers in SHAPES.items():
        for layer, (n, k) in layers.items():
            qws, ours = weight_rotation(n, k, gen)
            for m in (1, 5):
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                one_block = skinny.skinny_gemm(x, qws[0], cluster_blocks=1)
                times = []
                for c in (*sizes, 0):  # 0: the launcher's rule
                    # Another split of K adds the same products in another order: bf16-rounding close, not equal.
                    torch.testing.assert_close(skinny.skinny_gemm(x, qws[0], cluster_blocks=c), one_block,
                                               rtol=2e-2, atol=2e-2)
                    times.append(time_per_call([lambda qw=qw, c=c, x=x: skinny.skinny_gemm(x, qw, cluster_blocks=c)
                                                for qw in ours]))
                print(f"{model:12s} {layer:8s} {m:2d} " + " ".join(f"{t:9.2f}" for t in times), flush=True)
            del qws, ours


def main() -> int:
    reason = skinny.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    if reason:
        print(reason)
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    if sys.argv[1:] == ["--clusters"]:
        time_cluster_sizes(gen)
        return 0
    max_rows, elements = skinny.device_limits()
    bw = copy_bandwidth()
    rows = []
    for model, layers in SHAPES.items():
        for layer, (n, k) in layers.items():
            for m in (m for m in range(1, max_rows + 1) if m * k <= elements):
                r = bench_shape(n, k, m, gen)
                r.update(model=model, layer=layer)
                rows.append(r)
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s "
          f"(read+write); bf16 activations, uint4b8 G={GROUP}; µs per call, CUDA-graph replay over >= 4x L2")
    print(f"{'model':12s} {'layer':8s} {'M':>2s} {'skinny':>8s} {'GB/s':>6s} {'%copy':>6s} {'tinygemm':>9s} "
          f"{'x tiny':>7s} {'bf16':>8s} {'x bf16':>7s} {'triton':>8s} {'x triton':>8s}  auto")
    for r in rows:
        gbs = r["bytes"] / (r["skinny_us"] * 1e-6) / 1e9
        tiny = r.get("tinygemm_us")
        print(f"{r['model']:12s} {r['layer']:8s} {r['m']:2d} {r['skinny_us']:8.2f} {gbs:6.0f} "
              f"{100 * gbs * 1e9 / bw:5.1f}% {tiny if tiny else float('nan'):9.2f} "
              f"{(tiny / r['skinny_us']) if tiny else float('nan'):6.2f}x {r['bf16_us']:8.2f} "
              f"{r['bf16_us'] / r['skinny_us']:6.2f}x"
              + (f" {r['triton_us']:8.2f} {r['triton_us'] / r['skinny_us']:7.2f}x" if "triton_us" in r else "")
              + (f"  {r['auto']} {r['auto_us']:.2f}" if "auto" in r else ""))
        if "tinygemm_error" in r:
            print("   tinygemm:", r["tinygemm_error"])
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_bandwidth": bw, "device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
