"""Sign and check commit and shard records with the cluster's key (HMAC-SHA256), or neither when no key is configured.

A commit record names each shard record's xxh3-128, and a shard record each chunk's:
whoever can write a tier could recompute them all. The HMAC of the record's body, under
a key only the cluster's daemons (and readers given the key file) hold, is what they
cannot recompute. The daemon signs every commit record it seals (ckptd.cluster.placement.seal_record)
and checks every one it parses (CommitRecord.from_bytes); ckpt.load_local and
ckpt.dcp.Reader(path=) check with the key in CKPTD_KEY_FILE when it is set. A shard record
is signed where the daemon that took the rank's snapshot over hashes it (Tier.write_shard),
and checked where one is taken without a signed commit record over it: a replica received
(ckptd.replication.receiving) and a shard record counted towards sealing a step
(ckptd.tiers.step_records). See docs/DESIGN.md "Signed commits" and docs/OPERATIONS.md
for keys and their rotation.
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from ckpt_core.errors import CorruptCheckpoint

KEY_BYTES_MIN = 32
KEY_FILE_ENV = "CKPTD_KEY_FILE"


def key_id(key: bytes) -> str:
    """Return the name a record carries for the key that signed it: 8 hex digits of the key's SHA-256."""
    return hashlib.sha256(key).hexdigest()[:8]


def read_key(path: str | Path) -> bytes:
    """Read a key file: at least 32 bytes, as hex (one line) or raw; raise ValueError saying what is wrong.

    A key file others may read is refused: whoever reads it can sign commits.
    """
    path = Path(path)
    try:
        st = path.stat()
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the key file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"the key file {path} is not a regular file")
    if st.st_mode & 0o007:
        raise ValueError(f"the key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read it "
                         "(chmod 0600, or 0640 for the daemon's group)")  # fmt: skip
    text = data.strip()
    try:
        key = binascii.unhexlify(text) if text and len(text) % 2 == 0 else data
    except binascii.Error:
        key = data
    if len(key) < KEY_BYTES_MIN:
        raise ValueError(f"the key file {path} holds {len(key)} bytes of key; a key has at least {KEY_BYTES_MIN}")
    return key


class Signed(Protocol):
    """A record that carries a signature (ckpt_core.format's CommitRecord and ShardMeta): frozen dataclasses."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # what dataclasses.replace needs
    RECORD_NAME: ClassVar[str]  # "commit record", "shard record": what an error names

    @property
    def key_id(self) -> str: ...

    @property
    def hmac_sha256(self) -> str: ...

    def signed_body(self) -> bytes: ...


R = TypeVar("R", bound=Signed)


@dataclass(frozen=True)
class CommitKeys:
    """The keys that sign commit and shard records (the first) and check them (all); none: signing off.

    Built once where a daemon or a command starts (ckptd.config.Config.commit_keys) or a
    reader opens a directory (from_env), then only read, from any thread.
    """

    keys: tuple[bytes, ...] = field(default=(), repr=False)  # the signing key first, then the previous keys

    @classmethod
    def from_files(cls, key_file: str, previous_key_files: tuple[str, ...] = ()) -> CommitKeys:
        """Read the signing key and the keys kept for checking only; raise ValueError on a bad file."""
        if not key_file:
            if previous_key_files:
                raise ValueError("previous key files without a key file: set the key file to sign with")
            return UNSIGNED
        return cls(tuple(read_key(p) for p in (key_file, *previous_key_files)))

    @classmethod
    def from_env(cls) -> CommitKeys:
        """Read the key file env CKPTD_KEY_FILE names (a reader with no daemon); unset: nothing checked."""
        try:
            return cls.from_files(os.environ.get(KEY_FILE_ENV, ""))
        except ValueError as e:
            raise CorruptCheckpoint(f"cannot check commit records: {e}") from None

    @property
    def signing(self) -> bool:
        """Say whether records are signed and checked (a key is configured)."""
        return bool(self.keys)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Return the ids of the keys, the signing key's first (said at start; never the keys)."""
        return tuple(key_id(k) for k in self.keys)

    def sign(self, record: R) -> R:
        """Return record signed with the signing key (unchanged with signing off)."""
        if not self.keys:
            return record
        unsigned = dataclasses.replace(record, key_id=key_id(self.keys[0]), hmac_sha256="")
        return dataclasses.replace(unsigned, hmac_sha256=_mac(self.keys[0], unsigned.signed_body()))

    def check(self, record: R, what: str) -> R:
        """Return record if it carries a valid signature by one of the keys; raise CorruptCheckpoint otherwise.

        With signing off every record passes, signed or not: the signature is then not read.
        """
        if not self.keys:
            return record
        name = record.RECORD_NAME
        if not record.hmac_sha256:
            raise CorruptCheckpoint(f"{what}: the {name} is not signed (signing is on: [security] key_file)")
        key = next((k for k in self.keys if key_id(k) == record.key_id), None)
        if key is None:
            raise CorruptCheckpoint(f"{what}: the {name} is signed with an unknown key {record.key_id[:16]!r}")
        if not hmac.compare_digest(_mac(key, record.signed_body()), record.hmac_sha256):
            raise CorruptCheckpoint(f"{what}: the {name}'s signature does not match (key {record.key_id!r})")
        return record


def _mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


UNSIGNED = CommitKeys()
