"""Groups and their advantages (``training/groups.py``): pure arithmetic, no model."""

from __future__ import annotations

import pytest

from training.groups import (
    Group,
    Sample,
    Trajectory,
    assign_advantages,
    group_advantages,
    process_advantages,
    similar_batches,
)


def _group(key: str, rewards: list[float], success: list[float | None] | None = None) -> Group:
    return Group(key=key, trajectories=[
        Trajectory(id=f"{key}-{i}", reward=r, samples=[], success=(success or [None] * len(rewards))[i])
        for i, r in enumerate(rewards)])


# -- advantages ------------------------------------------------------------------------------------------------


def test_grpo_advantages_are_normalised_by_the_group_mean_and_sample_std() -> None:
    # mean 0.5; sample std sqrt(4 * 0.25 / 3) = 0.57735; (1 - 0.5) / (0.57735 + 0.0001) = 0.86588
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "grpo") == pytest.approx([0.86588, -0.86588, -0.86588, 0.86588],
                                                                           abs=1e-5)
    # mean 2; sample std sqrt((1 + 0 + 1) / 2) = 1; (3 - 2) / 1.0001 = 0.99990
    assert group_advantages([3.0, 2.0, 1.0], "grpo") == pytest.approx([0.99990, 0.0, -0.99990], abs=1e-5)


def test_rloo_advantages_subtract_the_mean_of_the_others() -> None:
    # 1 - (0 + 0.5) / 2 = 0.75; 0 - (1 + 0.5) / 2 = -0.75; 0.5 - (1 + 0) / 2 = 0
    assert group_advantages([1.0, 0.0, 0.5], "rloo") == pytest.approx([0.75, -0.75, 0.0])
    # 2 - (4 + 6 + 0) / 3 = -1.3333; 4 - 8/3 = 1.3333; 6 - 2 = 4; 0 - 4 = -4
    assert group_advantages([2.0, 4.0, 6.0, 0.0], "rloo") == pytest.approx([-4 / 3, 4 / 3, 4.0, -4.0])


def test_a_group_without_reward_spread_has_zero_advantages_and_is_flagged() -> None:
    assert group_advantages([0.7, 0.7, 0.7], "grpo") == [0.0, 0.0, 0.0]
    assert group_advantages([0.7, 0.7], "rloo") == [0.0, 0.0]
    assert group_advantages([1.0], "grpo") == [0.0]
    assert _group("g", [0.7, 0.7]).flat and not _group("h", [0.7, 0.8]).flat
    with pytest.raises(ValueError, match="unknown algorithm"):
        group_advantages([1.0, 0.0], "ppo")  # type: ignore[arg-type]


def test_each_step_gets_its_trajectory_advantage_plus_its_own_normalised_process_reward() -> None:
    group = Group(key="g", trajectories=[
        Trajectory(id="a", reward=1.0, samples=[Sample([1], [2], [-0.1], seq=0, temperature=1.0),
                                                Sample([1], [3], [-0.2], seq=1, temperature=1.0)],
                   step_rewards={0: 1.0, 1: 0.0}),
        Trajectory(id="b", reward=0.0, samples=[Sample([1], [4], [-0.3], seq=0, temperature=1.0)],
                   step_rewards={0: 0.5}),
    ])
    # process rewards 1, 0, 0.5: mean 0.5, sample std 0.5; normalised 1 / 0.5001 = 0.9998, -0.9998, 0
    assert process_advantages(group) == pytest.approx({("a", 0): 0.99980, ("a", 1): -0.99980, ("b", 0): 0.0},
                                                      abs=1e-5)
    assign_advantages([group], "rloo", process_coef=0.5)
    a0, a1 = group.trajectories[0].samples
    (b0,) = group.trajectories[1].samples
    # outcome: rloo of [1, 0] = [1, -1]
    assert a0.advantage == pytest.approx(1 + 0.5 * 0.99980, abs=1e-5)
    assert a1.advantage == pytest.approx(1 - 0.5 * 0.99980, abs=1e-5)
    assert b0.advantage == pytest.approx(-1.0)
    assign_advantages([group], "rloo", process_coef=0.0)
    assert [s.advantage for s in group.samples()] == [1.0, 1.0, -1.0]


def test_batches_hold_groups_of_similar_difficulty() -> None:
    groups = [_group(f"g{i}", [1.0, 0.0, 0.0, 0.0], [s, 0.0, 0.0, 0.0]) for i, s in enumerate([1.0] * 4)] + \
             [_group(f"h{i}", [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]) for i in range(4)]
    batches = similar_batches(groups, 4, seed=3)
    assert sorted(len(b) for b in batches) == [4, 4]
    for batch in batches:
        assert len({g.difficulty for g in batch}) == 1  # never easy and hard tasks in one batch
    assert {g.difficulty for g in groups} == {0.75, 1.0}
