"""Adapter folders as uploaded archives: packing one (the CLI, training) and unpacking one safely (the gateway).

An archive is a tar file, compressed or not, holding a peft adapter folder: ``adapter_config.json`` and its
weights, at the top level or inside one directory. Unpacking refuses links, devices, absolute paths and
``..`` (tarfile's ``data`` filter, plus an explicit check), and stops at a size limit on the unpacked bytes,
so an archive cannot write outside its folder or fill the disk.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from replay.adapters import RegistryError

CONFIG_FILE = "adapter_config.json"
EXPANSION_LIMIT = 4  # unpacked bytes may be at most this many times the archive limit


def pack(folder: str | Path) -> bytes:
    """A gzipped tar of an adapter folder's files (not its subfolders' caches), named relative to it."""
    root = Path(folder)
    if not (root / CONFIG_FILE).is_file():
        raise RegistryError(f"{root} is not an adapter folder: it has no {CONFIG_FILE}", code="invalid_adapter_path")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(root.iterdir()):
            if path.is_file():
                tar.add(path, arcname=path.name)
    return buffer.getvalue()


class Unpacked:
    """An archive unpacked into a staging folder, waiting to be moved to its final place (or discarded)."""

    def __init__(self, staging: Path, folder: Path, *, made_parent: bool) -> None:
        self.staging = staging
        self.folder = folder
        self.made_parent = made_parent  # the staging folder's parent was made for this upload

    def move_to(self, final: Path) -> str:
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():  # left by an upload whose registration failed after the move
            shutil.rmtree(final)
        self.folder.rename(final)
        self.discard()
        return str(final.resolve())

    def discard(self) -> None:
        """Removes the staging folder, and the parent made for it when nothing else landed there."""
        _remove(self.staging, self.made_parent)


def _remove(staging: Path, made_parent: bool) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    if made_parent:
        with contextlib.suppress(OSError):  # not empty: another version or upload lives there
            staging.parent.rmdir()


def unpack(data: bytes, destination: Path, *, max_bytes: int) -> Unpacked:
    """Unpack an archive into a new staging folder under ``destination``. Raises RegistryError (400) for
    anything unsafe or not an adapter."""
    made_parent = not destination.exists()
    destination.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".upload-", dir=destination))
    try:
        try:
            tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
        except tarfile.TarError as exc:
            raise RegistryError(f"the upload is not a tar archive: {exc}", code="invalid_archive") from None
        with tar:
            members = tar.getmembers()
            total = 0
            for member in members:
                parts = PurePosixPath(member.name).parts
                if member.name.startswith("/") or ".." in parts:
                    raise RegistryError(f"archive member {member.name!r} points outside its folder",
                                        code="invalid_archive")
                if not (member.isfile() or member.isdir()):
                    raise RegistryError(f"archive member {member.name!r} is not a plain file or folder",
                                        code="invalid_archive")
                total += member.size
                if total > max_bytes * EXPANSION_LIMIT:
                    raise RegistryError("the archive unpacks to more than the upload limit allows",
                                        code="archive_too_large")
            try:
                tar.extractall(staging, members=members, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise RegistryError(f"the archive cannot be unpacked: {exc}", code="invalid_archive") from None
        return Unpacked(staging, _adapter_folder(staging), made_parent=made_parent)
    except BaseException:
        _remove(staging, made_parent)
        raise


def _adapter_folder(root: Path) -> Path:
    if (root / CONFIG_FILE).is_file():
        return root
    children = [p for p in root.iterdir()]
    if len(children) == 1 and children[0].is_dir() and (children[0] / CONFIG_FILE).is_file():
        return children[0]
    raise RegistryError(f"the archive holds no {CONFIG_FILE}, at its top or in one folder", code="invalid_archive")
