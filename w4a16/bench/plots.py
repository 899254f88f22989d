"""One PNG per model: µs per call vs M (both log-scaled), a line per backend, one panel per layer, and the
bandwidth floor (our int4 bytes at the measured copy bandwidth) as a dashed line. matplotlib is imported here
only, when a plot is drawn."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import metrics
from .catalogue import BACKENDS, DEFAULT_FORMAT, LAYERS, OURS
from .results import Record


def plot_models(records: Iterable[Record], copy_gbps: float | None, out_dir: str | Path,
                title_suffix: str = "") -> list[Path]:
    """Write `<model>.png` for every model with at least two M values in one layer; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on GPU machines and CI
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_model: dict[str, list[Record]] = {}
    for r in records:
        if (r.dtype, r.group_size, r.symmetric) == DEFAULT_FORMAT:  # variants are tabled, not plotted
            by_model.setdefault(r.model, []).append(r)
    paths = []
    for model, recs in sorted(by_model.items()):
        layers = [lay for lay in LAYERS if len({r.m for r in recs if r.layer == lay}) >= 2]
        if not layers:
            continue
        fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 4.0), squeeze=False)
        for ax, layer in zip(axes[0], layers, strict=True):
            mine = [r for r in recs if r.layer == layer]
            n, k = mine[0].n, mine[0].k
            for backend in BACKENDS:
                pts = sorted((r.m, r.us) for r in mine if r.backend == backend)
                if pts:
                    ax.plot([m for m, _ in pts], [us for _, us in pts], marker="o", markersize=3, label=backend,
                            linewidth=2.0 if backend == "auto" else 1.0,
                            linestyle="-" if backend in OURS else "--")
            if copy_gbps:
                ms = sorted({r.m for r in mine})
                floor = [metrics.floor_bytes(n, k, m, 128, True) / (copy_gbps * 1e9) * 1e6 for m in ms]
                ax.plot(ms, floor, color="black", linestyle=":", linewidth=1.5,
                        label=f"bandwidth floor ({copy_gbps:.0f} GB/s)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("M (rows)")
            ax.set_ylabel("µs per call")
            ax.set_title(f"{layer}  N={n} K={k}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{model} W4A16 GEMM, bf16, g128{title_suffix}")
        fig.tight_layout()
        path = out_dir / f"{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
