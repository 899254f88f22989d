"""The speed harness behind `nox -s bench` (also `python -m w4a16.bench`).

One concern per module, all importable on a machine without a GPU (the CPU tests check the logic):

    catalogue  model shapes x M values x backends, and the named sets (quick, baseline, full)
    metrics    bytes and FLOPs per case, rotation sizing against the L2 size
    timing     CUDA/HIP-graph replay timed with device events, the device clock pytest-benchmark reads, copy bandwidth
    peers      the callables timed: our backends through `w4a16.gemm`, and torch matmul, naive, tinygemm
    results    pytest-benchmark JSON -> records, per-shape tables, the regression check against a stored baseline
    plots      one PNG per model: time vs M for every backend, with the bandwidth floor
    e2e        TTFT and TPOT of Llama-3.1-8B- and Qwen3-4B-shaped transformers models, W4A16 vs bf16
    cli        option parsing and the run itself
"""
