"""Say whether a directory is one only its owner could have prepared: the one rule for paths whose names are known.

The client calls dir_problem on the default socket's directory (daemon_socket.check_default_socket);
the daemon on every directory it makes or takes over: its socket's, its NVMe root, its staging
directory and the job directories in it (ckptd.storage.owned_dir). Any thread.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Collection
from pathlib import Path


def dir_problem(directory: Path, owners: Collection[int], group_may_write: bool = True) -> str | None:
    """Say what makes a directory one another user could have prepared, or None where it is sound.

    Sound: absent, or a real directory (not a link) owned by one of owners that no other user may
    write in (nor its group, unless group_may_write). A directory another user made first
    (/tmp/ckptd-UID, /dev/shm/ckptd-UID-...: names anyone can take) lets them serve a fake daemon,
    read the snapshots staged in it, or plant files and links the owner would then trust.
    """
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symbolic link (to {os.readlink(directory)})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid not in owners:
        return f"{directory} belongs to {user_name(st.st_uid)}, not to uid {' or '.join(map(str, sorted(owners)))}"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH:
        return f"every user may write in {directory} (mode {mode:o})"
    if st.st_mode & stat.S_IWGRP and not group_may_write:
        return f"the members of group {st.st_gid} may write in {directory} (mode {mode:o})"
    return None


def user_name(uid: int) -> str:
    """Name a user as messages show it: 'uid 65534 (nobody)', or 'uid N' where no account has that uid."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
