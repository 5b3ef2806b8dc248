"""claim_dir makes a directory at its mode whatever the umask, and takes over only a sound one (issue 34)."""

from __future__ import annotations

import os
import stat

import pytest
from ckpt_core.errors import InvalidArgument

from ckptd.storage.durable_write import replace_file
from ckptd.storage.owned_dir import StagingAccess, UnsafePath, claim_dir


@pytest.fixture
def umask_077():
    before = os.umask(0o077)
    yield
    os.umask(before)


def test_a_missing_directory_is_made_with_its_mode_and_group_whatever_the_umask(tmp_path, umask_077):
    claim_dir(tmp_path / "d", 0o750, "the test directory", "test.dir", gid=0)
    st = os.lstat(tmp_path / "d")
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == 0


def test_a_group_writable_directory_is_taken_over_only_where_a_group_is_configured(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(UnsafePath, match=r"refusing the test directory .* \(test\.dir\): the members of group"):
        claim_dir(shared, 0o700, "the test directory", "test.dir")
    claim_dir(shared, 0o750, "the test directory", "test.dir", gid=os.getegid())  # the group's to write in
    claim_dir(shared, 0o750, "the test directory", "test.dir", group_may_write=True)


def test_a_staging_group_is_a_name_or_a_gid_and_an_unknown_name_is_a_config_error():
    assert StagingAccess.of_group("").gid is None and StagingAccess.of_group("").slot_mode == 0o600
    assert StagingAccess.of_group("0").gid == 0 and StagingAccess.of_group("0").slot_mode == 0o660
    with pytest.raises(InvalidArgument, match=r"config key staging\.group: there is no group 'no-such-group-34'"):
        StagingAccess.of_group("no-such-group-34")


def test_a_link_planted_at_the_temporary_name_is_removed_never_written_through(tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious")
    (tmp_path / "record.tmp").symlink_to(precious)
    replace_file(tmp_path / "record", b"new", 0o600)
    assert precious.read_bytes() == b"precious"
    assert (tmp_path / "record").read_bytes() == b"new" and not (tmp_path / "record.tmp").exists()
    assert stat.S_IMODE(os.lstat(tmp_path / "record").st_mode) == 0o600
