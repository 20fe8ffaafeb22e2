"""The adapter registry on a real SQLite file, and adapter archives."""

from __future__ import annotations

import io
import sqlite3
import tarfile
from pathlib import Path

import pytest

from gateway.adapters import archive
from replay.adapters import AdapterRegistry, RegistryError, parse_ref


@pytest.fixture
def registry(tmp_path: Path) -> AdapterRegistry:
    return AdapterRegistry(str(tmp_path / "harness.db"))


def test_versions_count_up_per_name_and_start_as_unpublished_candidates(registry: AdapterRegistry) -> None:
    first = registry.register("sql", "qwen", "/a/1", metrics={"success": 0.5})
    second = registry.register("sql", "qwen", "/a/2")
    other = registry.register("chat", "qwen", "/c/1")
    assert (first.version, second.version, other.version) == (1, 2, 1)
    assert (second.status, second.published, second.backend_name) == ("candidate", False, "sql@2")
    assert registry.get("sql", 1).metrics == {"success": 0.5}
    assert registry.get("sql").version == 2  # no version: the newest
    assert [v.backend_name for v in registry.all()] == ["chat@1", "sql@1", "sql@2"]


def test_a_name_keeps_one_base_model(registry: AdapterRegistry) -> None:
    registry.register("sql", "qwen", "/a/1")
    with pytest.raises(RegistryError) as caught:
        registry.register("sql", "llama", "/a/2")
    assert caught.value.status == 409


@pytest.mark.parametrize("name", ["", "a:b", "a@1", "../x", "a/b", "x" * 65])
def test_names_that_would_break_model_names_or_paths_are_refused(registry: AdapterRegistry, name: str) -> None:
    with pytest.raises(RegistryError):
        registry.register(name, "qwen", "/a")


def test_promote_makes_one_version_active_and_records_the_parent(registry: AdapterRegistry) -> None:
    registry.register("sql", "qwen", "/a/1")
    registry.register("sql", "qwen", "/a/2")
    promoted, replaced = registry.promote("sql", 1)
    assert (promoted.status, promoted.published, replaced) == ("active", True, None)
    promoted, replaced = registry.promote("sql", 2)
    assert promoted.status == "active" and replaced.version == 1
    assert registry.get("sql", 1).status == "candidate" and not registry.get("sql", 1).published
    assert registry.register("sql", "qwen", "/a/3").parent_version == 2  # trained from the active one


def test_rollback_goes_back_one_active_version_at_a_time(registry: AdapterRegistry) -> None:
    for i in (1, 2, 3):
        registry.register("sql", "qwen", f"/a/{i}")
        registry.promote("sql", i)
    restored, demoted = registry.rollback("sql")
    assert (restored.version, demoted.version) == (2, 3)
    restored, demoted = registry.rollback("sql")
    assert (restored.version, demoted.version) == (1, 2)
    with pytest.raises(RegistryError) as caught:
        registry.rollback("sql")
    assert caught.value.status == 409 and caught.value.code == "nothing_to_roll_back"
    assert [v.status for v in registry.all()] == ["active", "candidate", "candidate"]


def test_retired_versions_cannot_be_published_promoted_or_rolled_back_to(registry: AdapterRegistry) -> None:
    registry.register("sql", "qwen", "/a/1")
    registry.register("sql", "qwen", "/a/2")
    registry.promote("sql", 1)
    registry.promote("sql", 2)
    registry.retire("sql", 1)
    for action in (lambda: registry.publish("sql", 1), lambda: registry.promote("sql", 1),
                   lambda: registry.rollback("sql")):
        with pytest.raises(RegistryError) as caught:
            action()
        assert caught.value.status == 409


def test_unknown_names_and_versions_are_404s(registry: AdapterRegistry) -> None:
    for action in (lambda: registry.get("nope"), lambda: registry.promote("nope", 1),
                   lambda: registry.rollback("nope"), lambda: registry.retire("nope", 3)):
        with pytest.raises(RegistryError) as caught:
            action()
        assert caught.value.status == 404


def test_the_stamp_changes_with_every_change(registry: AdapterRegistry) -> None:
    stamps = [registry.stamp()]
    registry.register("sql", "qwen", "/a/1")
    stamps.append(registry.stamp())
    registry.publish("sql", 1)
    stamps.append(registry.stamp())
    # a change written with a clock behind the last one's (another replica's) still shows
    with sqlite3.connect(registry.path) as db:
        db.execute("UPDATE adapters SET status = 'retired', published = 0, updated_at = 0")
    stamps.append(registry.stamp())
    assert len(set(stamps)) == 4


def test_the_database_allows_only_one_active_version_per_name(registry: AdapterRegistry, tmp_path: Path) -> None:
    registry.register("sql", "qwen", "/a/1")
    registry.register("sql", "qwen", "/a/2")
    registry.promote("sql", 1)
    with sqlite3.connect(tmp_path / "harness.db") as conn, pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE adapters SET status = 'active' WHERE version = 2")


def test_refs_parse_name_and_version() -> None:
    assert parse_ref("sql") == ("sql", None)
    assert parse_ref("sql@12") == ("sql", 12)
    with pytest.raises(RegistryError):
        parse_ref("sql@latest")


# -- archives ----------------------------------------------------------------------------------------------


def adapter_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 4}')
    (root / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return root


def tar_of(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def test_pack_then_unpack_round_trips_an_adapter_folder(tmp_path: Path) -> None:
    source = adapter_folder(tmp_path / "src")
    unpacked = archive.unpack(archive.pack(source), tmp_path / "dest", max_bytes=1 << 20)
    final = Path(unpacked.move_to(tmp_path / "dest" / "sql" / "1"))
    assert sorted(p.name for p in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (final / "adapter_model.safetensors").read_bytes() == b"\0" * 64
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["sql"]  # the staging folder is gone


def test_an_archive_with_the_folder_inside_one_directory_is_accepted(tmp_path: Path) -> None:
    data = tar_of([(tarfile.TarInfo("lora/adapter_config.json"), b"{}"),
                   (tarfile.TarInfo("lora/adapter_model.safetensors"), b"x")])
    unpacked = archive.unpack(data, tmp_path, max_bytes=1 << 20)
    assert (unpacked.folder / "adapter_config.json").read_bytes() == b"{}"


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(("entries", "fragment"), [
    ([(tarfile.TarInfo("../evil.json"), b"{}")], "outside"),
    ([(tarfile.TarInfo("/etc/evil.json"), b"{}")], "outside"),
    ([(tarfile.TarInfo("adapter_config.json"), b"{}"), (_link("x", "/etc/passwd", tarfile.SYMTYPE), None)],
     "not a plain file"),
    ([(tarfile.TarInfo("adapter_config.json"), b"{}"), (_link("y", "adapter_config.json", tarfile.LNKTYPE), None)],
     "not a plain file"),
    ([(tarfile.TarInfo("weights.bin"), b"x")], "no adapter_config.json"),
])
def test_unsafe_or_wrong_archives_are_refused_and_leave_nothing(tmp_path: Path, entries: list, fragment: str) -> None:
    with pytest.raises(RegistryError) as caught:
        archive.unpack(tar_of(entries), tmp_path / "dest", max_bytes=1 << 20)
    assert fragment in caught.value.message
    assert not (tmp_path / "dest").exists()  # not even the folder made for it
    assert not (tmp_path / "evil.json").exists()


def test_an_archive_that_unpacks_past_the_limit_is_refused(tmp_path: Path) -> None:
    data = tar_of([(tarfile.TarInfo("adapter_config.json"), b"{}"),
                   (tarfile.TarInfo("adapter_model.safetensors"), b"\0" * 5000)])
    with pytest.raises(RegistryError) as caught:
        archive.unpack(data, tmp_path, max_bytes=1000)
    assert caught.value.code == "archive_too_large"


def test_garbage_is_not_an_archive(tmp_path: Path) -> None:
    with pytest.raises(RegistryError) as caught:
        archive.unpack(b"this is not a tar file", tmp_path, max_bytes=1 << 20)
    assert caught.value.code == "invalid_archive"
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []  # a folder that was there stays


def test_an_upload_whose_registration_fails_leaves_no_folder(tmp_path: Path) -> None:
    data = tar_of([(tarfile.TarInfo("adapter_config.json"), b"{}")])
    unpacked = archive.unpack(data, tmp_path / "adapters" / "sql", max_bytes=1 << 20)
    unpacked.discard()  # what the service does when registering it failed
    assert not (tmp_path / "adapters" / "sql").exists()
    (tmp_path / "adapters" / "sql" / "1").mkdir(parents=True)  # an earlier version
    archive.unpack(data, tmp_path / "adapters" / "sql", max_bytes=1 << 20).discard()
    assert [p.name for p in (tmp_path / "adapters" / "sql").iterdir()] == ["1"]
