"""Key files of a Flower deployment (:mod:`fedloom.runtime.flower_credentials`): private
from their creation on, and never written through a link or over an existing file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fedloom.runtime.flower_credentials import CredentialsError, main, write_credentials


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_folder_and_private_keys_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)  # the loosest umask: nothing narrows the modes for us
    try:
        write_credentials(tmp_path / "creds", clients=2)
    finally:
        os.umask(old)
    folder = tmp_path / "creds"
    assert _mode(folder) == 0o700
    for key in ("ca.key", "server.key", "client_0.key", "client_1.key"):
        assert _mode(folder / key) == 0o600, key
    assert _mode(folder / "ca.crt") == 0o644


def test_an_existing_file_or_link_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    folder = tmp_path / "creds"
    folder.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("the attacker's file")
    (folder / "client_1.key").symlink_to(target)
    with pytest.raises(CredentialsError, match="client_1.key exists"):
        write_credentials(folder, clients=2)
    assert sorted(p.name for p in folder.iterdir()) == ["client_1.key"]
    assert target.read_text() == "the attacker's file"


def test_a_linked_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "creds").symlink_to(real)
    with pytest.raises(CredentialsError, match="not a directory"):
        write_credentials(tmp_path / "creds", clients=1)
    assert list(real.iterdir()) == []


def test_the_command_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    main([str(tmp_path / "creds"), "--clients", "1"])
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "creds"), "--clients", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ca.crt exists" in err[0]
