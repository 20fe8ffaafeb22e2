import os
from pathlib import Path

import pytest

from gateway.config import ToolsSettings
from tools.builtin.write_file import build, write_text
from tools.context import ToolContext
from tools.executor import execute
from tools.spec import ToolError


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("untouched")
    return path


def write(workspace: Path, path: str, content: str = "new", max_bytes: int = 1000) -> str:
    return write_text(str(workspace), path, content, max_bytes=max_bytes)


def test_writes_inside_and_creates_folders(workspace: Path) -> None:
    assert write(workspace, "notes/2024/today.md", "héllo") == "wrote 6 bytes to notes/2024/today.md"
    assert (workspace / "notes/2024/today.md").read_text() == "héllo"
    write(workspace, "./notes/../top.txt", "x")
    assert (workspace / "top.txt").read_text() == "x"
    write(workspace, str(workspace / "absolute-inside.txt"), "y")
    assert (workspace / "absolute-inside.txt").read_text() == "y"
    assert sorted(p.name for p in workspace.iterdir()) == ["absolute-inside.txt", "notes", "top.txt"]  # no temp files


def test_replaces_an_existing_file_keeping_its_mode(workspace: Path) -> None:
    target = workspace / "run.sh"
    target.write_text("old")
    target.chmod(0o750)
    write(workspace, "run.sh", "new")
    assert target.read_text() == "new" and (target.stat().st_mode & 0o777) == 0o750


def test_workspace_is_created_when_missing(tmp_path: Path) -> None:
    write(tmp_path / "fresh", "a.txt")
    assert (tmp_path / "fresh" / "a.txt").read_text() == "new"


@pytest.mark.parametrize("path", ["../x", "a/../../x", "../outside/secret.txt", "/etc/passwd", "/tmp/x"])
def test_paths_outside_are_refused(workspace: Path, outside: Path, path: str) -> None:
    with pytest.raises(ToolError, match="outside the workspace"):
        write(workspace, path)
    assert (outside / "secret.txt").read_text() == "untouched"
    assert not (workspace.parent / "x").exists()


def test_absolute_path_to_outside_folder_is_refused(workspace: Path, outside: Path) -> None:
    with pytest.raises(ToolError, match="outside the workspace"):
        write(workspace, str(outside / "secret.txt"))
    assert (outside / "secret.txt").read_text() == "untouched"


def test_symlink_as_target_is_refused(workspace: Path, outside: Path) -> None:
    (workspace / "link.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(ToolError, match="link.txt is a symbolic link"):
        write(workspace, "link.txt")
    assert (outside / "secret.txt").read_text() == "untouched"
    # A dangling link could otherwise create a file outside.
    (workspace / "dangling").symlink_to(outside / "created.txt")
    with pytest.raises(ToolError, match="symbolic link"):
        write(workspace, "dangling")
    assert not (outside / "created.txt").exists()


@pytest.mark.parametrize("path", ["linkdir/secret.txt", "linkdir/new/deeper.txt", "real/linkdir/x.txt"])
def test_symlink_as_parent_folder_is_refused(workspace: Path, outside: Path, path: str) -> None:
    (workspace / "linkdir").symlink_to(outside, target_is_directory=True)
    (workspace / "real").mkdir()
    (workspace / "real" / "linkdir").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ToolError, match="goes through a symbolic link"):
        write(workspace, path)
    assert (outside / "secret.txt").read_text() == "untouched"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_hard_link_is_replaced_not_written_through(workspace: Path, outside: Path) -> None:
    os.link(outside / "secret.txt", workspace / "hard.txt")
    write(workspace, "hard.txt", "mine")
    assert (workspace / "hard.txt").read_text() == "mine"
    assert (outside / "secret.txt").read_text() == "untouched"


def test_other_refusals(workspace: Path) -> None:
    (workspace / "folder").mkdir()
    with pytest.raises(ToolError, match="not a regular file"):
        write(workspace, "folder")
    (workspace / "file").write_text("x")
    with pytest.raises(ToolError, match="goes through a symbolic link or a file"):
        write(workspace, "file/child.txt")
    with pytest.raises(ToolError, match="names the workspace itself"):
        write(workspace, ".")
    with pytest.raises(ToolError, match="the limit is 10"):
        write(workspace, "big.txt", "x" * 11, max_bytes=10)
    with pytest.raises(ToolError, match="NUL"):
        write(workspace, "a\0b")


async def test_through_the_executor(workspace: Path) -> None:
    settings = ToolsSettings(workspace=str(workspace))
    spec = build(settings)
    assert spec.requires_approval is True
    outcome = await execute(spec, {"path": "out.txt", "content": "done"}, ToolContext(settings))
    assert (outcome.status, outcome.output) == ("ok", "wrote 4 bytes to out.txt")
    outcome = await execute(spec, {"path": "../escape.txt", "content": "x"}, ToolContext(settings))
    assert outcome.output == "Tool write_file failed: ../escape.txt is outside the workspace"
