"""``[training]`` belongs to the training package; the whole composition adds it on top of the gateway's sections."""

from pathlib import Path

import pytest

from gateway.config import ConfigError, Settings, load_settings, load_with_sources, source_of
from training.settings import HarnessSettings, TrainingSettings


def test_one_file_serves_the_gateway_and_training(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[server]\nport = 8100\n[training]\nrank = 8\n[training.rl]\nsteps = 3\n")
    s, layers = load_with_sources(cfg, environ={"HARNESS_TRAINING__GATE__SAMPLES": "3",
                                                "HARNESS_TRAINING__GATE__TASKS": "40"}, model=HarnessSettings)
    assert isinstance(s, Settings) and s.server.port == 8100
    assert (s.training.rank, s.training.rl.steps, s.training.gate.tasks) == (8, 3, 40)
    assert source_of(layers, ("training", "rl", "steps")) == "file"
    assert source_of(layers, ("training", "gate", "tasks")) == "environment"
    assert source_of(layers, ("training", "alpha")) == "default"
    assert s.training == HarnessSettings.model_validate(s.model_dump()).training


def test_the_gateway_alone_does_not_know_training(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[training]\nrank = 8\n")
    with pytest.raises(ConfigError, match="training: unknown key"):
        load_settings(cfg, environ={})
    assert "training" not in Settings.model_fields


def test_training_mistakes_name_their_path(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[training]\nrnak = 8\n[training.gate]\ntasks = 10\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(cfg, environ={}, model=HarnessSettings)
    problems = caught.value.problems
    assert len(problems) == 2 and "training.rnak: unknown key" in problems
    assert any(p.startswith("training.gate: the gate needs at least 100 tasks") for p in problems)
    assert TrainingSettings().gate.tasks == 100


def test_a_served_teachers_key_comes_from_its_variable_never_from_the_file(tmp_path: Path) -> None:
    config = tmp_path / "harness.toml"
    config.write_text('[training.correction]\nteacher = "big-model"\nteacher_key_env = "MY_TEACHER_KEY"\n')
    settings = load_settings(config, environ={"MY_TEACHER_KEY": "sk-teacher"}, model=HarnessSettings)
    assert settings.training.correction.teacher_key == "sk-teacher"
    assert "sk-teacher" not in settings.model_dump_json()
    assert load_settings(config, environ={}, model=HarnessSettings).training.correction.teacher_key is None
