"""Ed25519 signatures over build manifests and program store entries.

A build's manifest lists the size and sha256 of every file in the build, so signing the
manifest's bytes signs the build; a store entry's `entry.json` does the same for the entry. The
signature sits beside the signed file (`manifest.sig`, `entry.sig`) as one line of JSON: the
signing key's id and the signature. Keys are PEM files made by `aot keygen`: the private key
(PKCS #8, mode 0600) signs at `aot build --sign-key`, the public key (`<key>.pub`) is what
`runtime run/serve --trusted-key` and `aot check --trusted-key` trust. A key's id is the first
16 hex digits of the sha256 of its raw public bytes. Key and signature files are outside data:
read with a bound, one line of error for anything wrong.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.trust.json_checks import ArtifactError
from wan.bounded_read import read_json, read_text
from wan.errors import InputError

SUFFIX = ".sig"  # manifest.json -> manifest.sig
MAX_KEY_BYTES = 4096  # a PEM Ed25519 key is about 120 bytes
MAX_SIGNATURE_BYTES = 4096
ALGORITHM = "ed25519"


class KeyFileError(InputError):
    """A key file cannot be used; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class TrustedKey:
    key: Any  # cryptography's Ed25519PublicKey
    key_id: str
    path: Path


@dataclasses.dataclass(frozen=True)
class SigningKey:
    key: Any  # cryptography's Ed25519PrivateKey
    key_id: str
    path: Path

    @property
    def public(self) -> TrustedKey:
        """Its public half: what a build it signs is checked against."""
        return TrustedKey(self.key.public_key(), self.key_id, self.path)


def key_id(public_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate(out: Path) -> tuple[Path, Path]:
    """A new key pair: the private key at `out` (mode 0600) and the public key at `out`.pub;
    neither file may exist already."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    public = out.with_name(out.name + ".pub")
    for path in (out, public):
        if os.path.lexists(path):
            raise KeyFileError(f"{path} exists: choose another --out (a key is never overwritten)")
    private_key = Ed25519PrivateKey.generate()
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
        public.write_bytes(public_pem)
    except OSError as e:
        raise KeyFileError(f"cannot write {out}: {e.strerror}") from None
    return out, public


def _pem(path: Path, what: str) -> bytes:
    def refuse(reason: str) -> KeyFileError:
        return KeyFileError(f"{what} {path} {reason}: make one with `aot keygen --out FILE`")

    return read_text(path, MAX_KEY_BYTES, refuse).encode()


def load_signing_key(path: Path) -> SigningKey:
    """The private key in the PEM file `path` (from `aot keygen`)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = _pem(path, "--sign-key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise KeyFileError(
            f"--sign-key {path} is not an unencrypted PEM private key ({e})"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"--sign-key {path} is not an Ed25519 key: make one with `aot keygen`")
    return SigningKey(key, key_id(key.public_key()), path)


def load_trusted_key(path: Path) -> TrustedKey:
    """The public key in the PEM file `path` (the `.pub` from `aot keygen`)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    pem = _pem(path, "--trusted-key")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"--trusted-key {path} is not a PEM public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"--trusted-key {path} is not an Ed25519 key: use `aot keygen`'s .pub")
    return TrustedKey(key, key_id(key), path)


def load_trusted_keys(paths: Sequence[Path]) -> tuple[TrustedKey, ...]:
    return tuple(load_trusted_key(Path(p)) for p in paths)


def signature_path(signed: Path) -> Path:
    return signed.with_suffix(SUFFIX)


def sign(signed: Path, key: SigningKey) -> Path:
    """Sign the bytes of the file `signed`: its signature file (written into the temporary
    folder a build or store entry is made in, published with it)."""
    signature = key.key.sign(signed.read_bytes())
    record = {"algorithm": ALGORITHM, "key_id": key.key_id,
              "signature": base64.b64encode(signature).decode()}  # fmt: skip
    path = signature_path(signed)
    path.write_text(json.dumps(record) + "\n")
    return path


def verify(signed: Path, data: bytes, trusted: Sequence[TrustedKey]) -> TrustedKey:
    """The trusted key whose signature (in `signed`'s signature file) is over `data`, the bytes
    read from `signed`; ArtifactError (one line) when unsigned, unreadable or signed by no
    trusted key."""
    from cryptography.exceptions import InvalidSignature

    path = signature_path(signed)
    if not os.path.lexists(path):
        raise ArtifactError(
            f"{signed} is not signed (no {path.name}): sign with `aot build --sign-key`"
        )
    record = read_json(
        path, MAX_SIGNATURE_BYTES, lambda r: ArtifactError(f"{path} {r}"), follow_symlinks=False
    )
    if not (
        isinstance(record, dict)
        and set(record) == {"algorithm", "key_id", "signature"}
        and record["algorithm"] == ALGORITHM
        and all(isinstance(record[k], str) for k in ("key_id", "signature"))
    ):
        raise ArtifactError(f"{path} is not a signature of `aot build --sign-key`")
    try:
        signature = base64.b64decode(record["signature"], validate=True)
    except ValueError:
        raise ArtifactError(f"{path} holds no base64 signature") from None
    for key in trusted:
        if key.key_id == record["key_id"]:
            try:
                key.key.verify(signature, data)
            except InvalidSignature:
                raise ArtifactError(
                    f"{signed} does not match its signature by key {key.key_id} ({key.path}): "
                    "it was changed after signing; rebuild and sign it again"
                ) from None
            return key
    ids = ", ".join(k.key_id for k in trusted)
    raise ArtifactError(
        f"{signed} is signed by key {record['key_id'][:16]!r}, not by a trusted key ({ids}): "
        "pass its public key with --trusted-key, or rebuild with your --sign-key"
    )
