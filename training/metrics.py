"""What an evaluation measures, as pure functions of its episodes.

Metrics (each in [0, 1] except ``mean_steps`` and ``general_perplexity``):

- ``success_rate``: episodes the verifier accepts;
- ``mean_steps``: model calls per episode;
- ``valid_call_rate``: of the episodes that need a tool (every family but ``cannot`` and ``no_tool``), those in
  which the model called at least one tool and every call it made was valid (a known, offered tool; arguments
  that satisfy its schema);
- ``invalid_call_rate``: invalid calls over all calls made (0 when none were made);
- ``recovery_rate``: of the episodes with an injected tool failure, those that still succeeded;
- ``unseen_tool_success_rate``: of the episodes offering a tool that no train or validation task offers (the
  tool is known to the model from its description alone), those that succeeded;
- ``direct_answer_rate``: of the episodes where no offered tool fits, those answered without any call, valid or
  not, and not refused (``answered_directly``; right or wrong: success also asks for the right word);
- ``general_perplexity``: perplexity on the held-out part of the general data (the general-ability check;
  lower is better), computed outside the loop with the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.stats import rate_bounds
from training.tasks.base import is_refusal

METRICS = ("success_rate", "mean_steps", "valid_call_rate", "invalid_call_rate", "recovery_rate",
           "unseen_tool_success_rate", "direct_answer_rate", "general_perplexity")
HIGHER_IS_BETTER = {"success_rate": True, "mean_steps": False, "valid_call_rate": True, "invalid_call_rate": False,
                    "recovery_rate": True, "unseen_tool_success_rate": True, "direct_answer_rate": True,
                    "general_perplexity": False}


Loss = tuple[float, int]  # one text: its summed negative log-likelihood, its tokens


@dataclass
class Episode:
    task_id: str
    family: str
    success: bool
    steps: int
    tool_calls: int
    invalid_calls: int
    needs_tools: bool
    faulted: bool
    status: str
    termination_reason: str | None
    final: str | None
    run_id: str
    unseen_tools: bool = False  # offered a tool no train or validation task offers
    direct: bool = False  # no offered tool fits: success is answering without a call


def answered_directly(episode: Episode) -> bool:
    """Whether an episode answered without making any call and without refusing."""
    final = episode.final or ""
    return episode.tool_calls == 0 and episode.invalid_calls == 0 and bool(final.strip()) and not is_refusal(final)


def metrics_of(episodes: list[Episode]) -> dict[str, float | None]:
    """The suite metrics of a list of episodes (``None`` where no episode qualifies)."""
    def share(hits: list[bool]) -> float | None:
        return sum(hits) / len(hits) if hits else None

    calls = sum(e.tool_calls for e in episodes)
    needing = [e for e in episodes if e.needs_tools]
    return {
        "success_rate": share([e.success for e in episodes]),
        "mean_steps": sum(e.steps for e in episodes) / len(episodes) if episodes else None,
        "valid_call_rate": share([e.tool_calls > 0 and e.invalid_calls == 0 for e in needing]),
        "invalid_call_rate": sum(e.invalid_calls for e in episodes) / calls if calls else 0.0,
        "recovery_rate": share([e.success for e in episodes if e.faulted]),
        "unseen_tool_success_rate": share([e.success for e in episodes if e.unseen_tools]),
        "direct_answer_rate": share([answered_directly(e) for e in episodes if e.direct]),
    }


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """The two-sided 95% Wilson score interval of a success rate. Unlike the normal approximation it stays inside
    [0, 1] and is not empty at 0 or n successes, which small evaluations often give."""
    return rate_bounds(successes, trials, confidence=0.975)  # each side 2.5%


def success_interval(episodes: list[Episode]) -> tuple[float, float] | None:
    """The 95% interval of the success rate the episodes estimate (None without episodes)."""
    return wilson_interval(sum(e.success for e in episodes), len(episodes)) if episodes else None


def perplexity_of(losses: list[Loss]) -> float:
    """exp of the mean negative log-likelihood per token over texts' losses."""
    return math.exp(sum(n for n, _ in losses) / sum(t for _, t in losses))


def rank(metrics: dict[str, float | None]) -> tuple[float, float, float]:
    """How checkpoints are ordered on validation: success, then valid calls, then fewer invalid calls."""
    return (metrics.get("success_rate") or 0.0, metrics.get("valid_call_rate") or 0.0,
            -(metrics.get("invalid_call_rate") or 0.0))


def format_value(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name == "mean_steps":
        return f"{value:.2f}"
    if name == "general_perplexity":
        return f"{value:.2f}"
    return f"{value:.0%}"
