"""write_file: writes a text file inside the workspace folder (``[tools] workspace``), and nowhere else.

The path is walked one directory at a time from the workspace's own descriptor, refusing to follow
any symbolic link (``O_NOFOLLOW``), so no link, planted before the call or swapped in during it, can
lead the write outside. The content goes to a temporary file that is then renamed over the target:
a rename replaces a link or a hard link rather than writing through it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from tools.context import ToolContext
from tools.settings import ToolsSettings
from tools.spec import ToolError, ToolSpec

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _relative_parts(workspace: Path, path: str) -> list[str]:
    """The path's components below the workspace, judged by name only (no link is followed here)."""
    if not path or "\0" in path:
        raise ToolError("the path is empty or contains a NUL character")
    candidate = PurePosixPath(path)
    if candidate.is_absolute():
        try:
            candidate = candidate.relative_to(workspace)
        except ValueError:
            raise ToolError(f"{path} is outside the workspace") from None
    parts: list[str] = []
    for part in candidate.parts:
        if part == "..":
            if not parts:
                raise ToolError(f"{path} is outside the workspace")
            parts.pop()
        elif part != ".":
            parts.append(part)
    if not parts:
        raise ToolError(f"{path} names the workspace itself, not a file in it")
    return parts


def _open_dir(parent: int, name: str, shown: str) -> int:
    """Opens (creating it when missing) one folder below ``parent``, never through a link."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
    except FileExistsError:
        pass  # a link or a file by that name is refused when opened below
    except OSError as exc:
        raise _refusal(exc, shown) from None
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise _refusal(exc, shown) from None


def _refusal(exc: OSError, shown: str) -> ToolError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return ToolError(f"{shown} goes through a symbolic link or a file; only real folders in the workspace are used")
    return ToolError(f"cannot use {shown}: {exc.strerror}")


def _replace(directory: int, name: str, data: bytes, existing: os.stat_result | None) -> None:
    temporary = f".{name[:200]}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                 dir_fd=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            if existing is not None:
                os.fchmod(handle.fileno(), stat.S_IMODE(existing.st_mode))
            handle.write(data)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        os.unlink(temporary, dir_fd=directory)
        raise


def write_text(workspace: str, path: str, content: str, *, max_bytes: int) -> str:
    """Writes ``content`` to ``path`` below ``workspace``; blocking, so callers run it in a worker thread."""
    data = content.encode("utf-8")
    if len(data) > max_bytes:
        raise ToolError(f"the content is {len(data)} bytes; the limit is {max_bytes}")
    root = Path(workspace).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    parts = _relative_parts(root, path)
    shown = "/".join(parts)
    fds = [os.open(root, _DIR_FLAGS)]
    try:
        for i, name in enumerate(parts[:-1]):
            fds.append(_open_dir(fds[-1], name, "/".join(parts[: i + 1])))
        directory, name = fds[-1], parts[-1]
        try:
            existing = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if existing is not None and not stat.S_ISREG(existing.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(existing.st_mode) else "not a regular file"
            raise ToolError(f"{shown} is {kind}; refusing to replace it")
        _replace(directory, name, data, existing)
    except OSError as exc:
        raise ToolError(f"cannot write {shown}: {exc.strerror}") from None
    finally:
        for fd in fds:
            os.close(fd)
    return f"wrote {len(data)} bytes to {shown}"


async def _run(arguments: dict[str, Any], context: ToolContext) -> str:
    settings = context.settings
    return await asyncio.to_thread(
        write_text, settings.workspace, arguments["path"], arguments["content"], max_bytes=settings.write_max_bytes)


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="write_file",
        description=(
            "Write a UTF-8 text file in the workspace, creating folders as needed and replacing an existing file. "
            "The path is relative to the workspace."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "minLength": 1, "description": "e.g. notes/summary.md"},
                "content": {"type": "string", "description": "the whole text of the file"},
            },
            "required": ["path", "content"],
            "additionalProperties": False,
        },
        run=_run,
        timeout=10.0,
        output_cap=settings.output_cap,
        permissions=frozenset({"filesystem:write"}),
        requires_approval=settings.write_requires_approval,
    )
