"""``loss.png``: the loss curve of a training run's log (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path


def write_loss_png(path: Path, log: dict, baseline: float, width: int = 640, height: int = 400) -> None:
    """The training loss per step (light) and its running mean over 1/30 of the steps
    (dark), the held-out evaluations (red squares, ``log["eval"]``: [step, loss] pairs),
    the unigram baseline (dashed grey); nats/token from 0 against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps, loss = np.asarray(log["steps"], dtype=float), np.asarray(log["loss"], dtype=float)
    dpi = 100
    figure, axes = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
    try:
        axes.plot(steps, loss, color="#9ecae1", linewidth=0.8, label="training loss")
        if len(loss):
            k = max(1, len(loss) // 30)
            mean = np.convolve(loss, np.ones(k) / k, mode="valid")
            axes.plot(steps[k - 1 :], mean, color="#08519c", linewidth=1.5, label=f"running mean ({k} steps)")
        if log.get("eval"):
            at, held = zip(*log["eval"])
            axes.plot(at, held, "s", color="#cb181d", markersize=4, label="held-out")
        axes.axhline(baseline, color="grey", linestyle="--", linewidth=1, label="unigram baseline")
        axes.set_ylim(0, max([baseline + 1.0, *loss]) if len(loss) else baseline + 1.0)
        axes.set_xlim(0, max(1.0, steps[-1] if len(steps) else 1.0))
        axes.set_xlabel("step")
        axes.set_ylabel("nats / token")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
