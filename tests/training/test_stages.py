"""Timed stages: each line says its own seconds; the records and the table keep what each processed."""

from __future__ import annotations

import io
import time

from rich.console import Console

from training.stages import Stages


def test_each_stage_is_timed_from_the_end_of_the_one_before() -> None:
    out = io.StringIO()
    stage = Stages(Console(file=out, width=120))
    time.sleep(0.05)
    stage("build", "12 rows", rows=12)
    stage("sft", "done", tokens=3400)
    build, sft = stage.records
    assert build["stage"] == "build" and build["rows"] == 12 and build["seconds"] >= 0.05
    assert sft["tokens"] == 3400 and sft["seconds"] < build["seconds"]
    assert "build     12 rows" in out.getvalue()
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(stage.table())
    text = console.export_text()
    assert "3,400 tokens" in text and "12 rows" in text and "stages:" in text
