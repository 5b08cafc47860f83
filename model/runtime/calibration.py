"""The DSpark confidence head's calibration: one temperature per draft position.

The head's raw survival estimates are over- or under-confident by position; Sequential
Temperature Scaling (the DSpark paper's STS) fits a temperature per position on
held-out drafts (``v41 train-drafter`` after training), and the speculative step
(:mod:`model.runtime.speculative`) applies it to every proposal. No I/O: the
temperatures are read and written as dicts by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Calibration:
    """Per-position temperatures of the confidence head: c_k = sigmoid(logit_k / T_k).

    Fitted with Sequential Temperature Scaling (the paper's STS): left to right, each
    T_k is the grid value that minimises the expected calibration error of the prefix
    survival prod_{i<=k} c_i against observed prefix acceptance, the earlier
    temperatures held fixed. Order-preserving at each position.
    """

    temperatures: list[float]
    ece_before: list[float] = field(default_factory=list)
    ece_after: list[float] = field(default_factory=list)

    @classmethod
    def identity(cls, positions: int) -> "Calibration":
        return cls([1.0] * positions)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Confidence logits [..., K] -> calibrated c [..., K]."""
        t = torch.tensor(self.temperatures[: logits.shape[-1]], dtype=torch.float32, device=logits.device)
        return torch.sigmoid(logits.float() / t)

    def to_dict(self) -> dict:
        return {"temperatures": [round(t, 6) for t in self.temperatures],
                "ece_before": [round(e, 6) for e in self.ece_before], "ece_after": [round(e, 6) for e in self.ece_after]}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        temperatures = [float(t) for t in data["temperatures"]]
        if not temperatures or any(not math.isfinite(t) or t <= 0 for t in temperatures):
            raise ValueError(f"calibration temperatures must be positive numbers, got {data['temperatures']!r}")
        return cls(temperatures, list(data.get("ece_before", [])), list(data.get("ece_after", [])))

    @classmethod
    def fit(cls, logits: torch.Tensor, accepted: torch.Tensor, bins: int = 10,
            grid: torch.Tensor | None = None) -> "Calibration":
        """STS on held-out blocks: ``logits`` [N, K] confidence logits, ``accepted`` [N, K]
        bool, True where the first k guesses all survived verification."""
        grid = torch.logspace(-1.0, 1.5, 241) if grid is None else grid
        logits, labels = logits.double(), accepted.double()
        temperatures, before, after = [], [], []
        prefix = torch.ones(logits.shape[0], dtype=torch.float64)
        raw_prefix = torch.ones_like(prefix)
        for k in range(logits.shape[1]):
            raw_prefix = raw_prefix * torch.sigmoid(logits[:, k])
            before.append(expected_calibration_error(raw_prefix, labels[:, k], bins))
            errors = torch.stack([torch.tensor(expected_calibration_error(prefix * torch.sigmoid(logits[:, k] / t),
                                                                           labels[:, k], bins)) for t in grid])
            best = float(grid[int(errors.argmin())])
            temperatures.append(best)
            prefix = prefix * torch.sigmoid(logits[:, k] / best)
            after.append(float(errors.min()))
        return cls(temperatures, before, after)


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, bins: int = 10) -> float:
    """ECE of probabilities ``predicted`` [N] against 0/1 outcomes ``observed`` [N], equal-width bins."""
    index = (predicted * bins).long().clamp_(0, bins - 1)
    pred = torch.zeros(bins, dtype=torch.float64).scatter_add_(0, index, predicted.double())
    obs = torch.zeros(bins, dtype=torch.float64).scatter_add_(0, index, observed.double())
    return float((pred - obs).abs().sum() / max(1, predicted.numel()))
