"""The training figures, as PNGs: SFT's loss, and RL's reward, KL and validation per step.

Drawn on matplotlib's Agg canvas directly: no pyplot, so no global backend is chosen for the caller's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.rl import RLResult


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction, so the first points are not pulled towards 0."""
    out, average = [], 0.0
    for i, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** i))
    return out


def plot_loss(losses: list[float], path: Path) -> None:
    """Loss per step, raw and smoothed, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    steps = range(1, len(losses) + 1)
    axes.plot(steps, losses, alpha=0.3, label="loss")
    axes.plot(steps, smooth(losses), label="smoothed")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (completion tokens)")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


def plot_rl(result: RLResult, path: Path) -> None:
    """Training reward, KL to the base and the validation metrics per step, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 4), dpi=100)
    FigureCanvasAgg(figure)
    reward_axes, kl_axes, validation_axes = figure.subplots(1, 3)
    steps = [h["step"] for h in result.history if h.get("reward") is not None]
    rewards = [h["reward"] for h in result.history if h.get("reward") is not None]
    reward_axes.plot(steps, rewards, alpha=0.4, label="mean reward")
    if rewards:
        reward_axes.plot(steps, smooth(rewards, 0.7), label="smoothed")
    reward_axes.set_title("training reward")
    reward_axes.legend(fontsize=8)
    kl = [(h["step"], h["kl"]) for h in result.history if "kl" in h]
    kl_axes.plot([s for s, _ in kl], [v for _, v in kl])
    kl_axes.set_title("KL to the base model")
    marks = {"rollback": "v", "alarm": "X", "stop": "X"}
    for metric in ("success_rate", "valid_call_rate"):
        points = [(v["step"], v["metrics"].get(metric) or 0.0) for v in result.validations]
        validation_axes.plot([s for s, _ in points], [v for _, v in points], marker="o", label=metric)
    for v in result.validations:
        if v["action"] in marks:
            validation_axes.axvline(v["step"], color="red", alpha=0.3)
            validation_axes.plot([v["step"]], [v["metrics"].get("success_rate") or 0.0], marks[v["action"]],
                                 color="red", label=v["action"])
    validation_axes.set_ylim(0, 1)
    validation_axes.set_title("validation")
    validation_axes.legend(fontsize=8)
    for axes in (reward_axes, kl_axes, validation_axes):
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
