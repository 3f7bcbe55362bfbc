"""The tenant key file: refused when anyone but its owner can read it, too short, malformed or
missing (the message names tenant_key_file and the path, never a key); `layerkv keygen` writes
one and rotates it; nothing of a key shows in a repr."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerkv.cli import main
from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError
from layerkv.objects.tenant_key import MIN_KEY_NBYTES, read_key_file, tenant_keys, write_key_file


def _key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_keygen_writes_an_owner_only_file_and_rotates_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tenant.key"
    assert main(["keygen", str(path)]) == 0
    assert (path.stat().st_mode & 0o777) == 0o600
    first = read_key_file(path)
    assert len(first.all) == 1
    secret = [line for line in path.read_text().splitlines() if not line.startswith("#")][0]
    assert len(bytes.fromhex(secret)) == MIN_KEY_NBYTES
    out = capsys.readouterr().out
    assert first.current.key_id in out and secret not in out
    assert main(["keygen", str(path)]) == 2  # never overwritten
    assert "exists; use --rotate" in capsys.readouterr().err
    rotated = write_key_file(path, rotate=True)
    assert len(rotated.all) == 2 and rotated.all[1].key_id == first.current.key_id
    assert rotated.current.key_id != first.current.key_id and (path.stat().st_mode & 0o777) == 0o600
    for shown in (repr(rotated), repr(rotated.current), str(rotated.all)):
        assert secret not in shown and secret[:16] not in shown
        assert rotated.current.mac_key.hex()[:16] not in shown


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    secret = os.urandom(32).hex()
    path = _key_file(tmp_path / "k", secret + "\n", mode)
    with pytest.raises(
        ConfigError, match=rf"tenant_key_file='{path}' is readable by group or others \(mode 0{mode:o}\); chmod 600"
    ) as info:
        read_key_file(path)
    assert secret not in str(info.value)


def test_bad_key_files_are_refused_naming_the_key_not_the_contents(tmp_path: Path) -> None:
    short = os.urandom(31).hex()
    with pytest.raises(ConfigError, match=r"line 2 holds 31 bytes; a tenant key needs at least 32") as info:
        read_key_file(_key_file(tmp_path / "short", "# comment\n" + short + "\n"))
    assert short not in str(info.value)
    with pytest.raises(ConfigError, match="line 1 is not hex") as info:
        read_key_file(_key_file(tmp_path / "text", "my secret passphrase that is long enough\n"))
    assert "passphrase" not in str(info.value)
    with pytest.raises(ConfigError, match="holds no key"):
        read_key_file(_key_file(tmp_path / "empty", "# nothing\n\n"))
    with pytest.raises(ConfigError, match=r"tenant_key_file='.*missing' cannot be opened"):
        read_key_file(tmp_path / "missing")
    with pytest.raises(ConfigError, match="must be a regular file"):
        read_key_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(_key_file(tmp_path / "real", os.urandom(32).hex()))
    with pytest.raises(ConfigError, match="cannot be opened"):  # O_NOFOLLOW: a link could point anywhere
        read_key_file(link)


def test_the_config_takes_the_key_file_from_the_environment(tmp_path: Path) -> None:
    path = _key_file(tmp_path / "k", os.urandom(32).hex())
    config = LayerKVConfig.from_dict({}, env={"LAYERKV_TENANT_KEY_FILE": str(path)})
    assert config.tenant_key_file == str(path)
    assert (
        LayerKVConfig.from_dict(
            {"tenant_key_file": "/other"}, env={"LAYERKV_TENANT_KEY_FILE": str(path)}
        ).tenant_key_file
        == "/other"
    )
    keys = tenant_keys(config.tenant_key_file)
    assert keys is not None and len(keys.current.names_key) == 32
    assert tenant_keys(None) is None
    with pytest.raises(ConfigError, match="unknown layerkv config key.*'verify_checksums'"):
        LayerKVConfig.from_dict({"verify_checksums": False}, env={})  # no serving switch turns verification off
    subkeys = {keys.current.names_key, keys.current.mac_key, keys.current.encryption_key}
    assert len(subkeys) == 3 and bytes.fromhex(path.read_text().strip()) not in subkeys
