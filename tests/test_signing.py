"""Signed artifacts: `aot keygen`, `aot build --sign-key` signing each manifest and store entry,
and `runtime run`/`runtime serve`/`aot check --trusted-key` refusing an unsigned, mis-signed or
tampered build in one line, before any executable is read."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import TINY_SHAPE, run_cli

from aot.building import store
from runtime.builds.artifact import MANIFEST, ArtifactError, read_manifest, sha256_file
from runtime.trust import signing

RUN = [*TINY_SHAPE, "--prompt", "a cat", "--steps", "1"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Two key pairs made by `aot keygen`: the builder's and someone else's."""
    folder = tmp_path_factory.mktemp("keys")
    for name in ("builder", "other"):
        result = run_cli("aot", "keygen", "--out", str(folder / name))
        assert "key id" in result.stdout
    return {
        "builder": folder / "builder",
        "builder.pub": folder / "builder.pub",
        "other": folder / "other",
        "other.pub": folder / "other.pub",
    }


@pytest.fixture(scope="module")
def signed(tmp_path_factory, keys) -> Path:
    """The tiny build, made with `aot build --sign-key`: its artifacts folder."""
    out = tmp_path_factory.mktemp("signed") / "artifacts"
    run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8", "--out", str(out),
            "--sign-key", str(keys["builder"]))  # fmt: skip
    return out


def the_build(artifacts: Path) -> Path:
    (folder,) = [p for p in artifacts.iterdir() if p.name.startswith("tiny_")]
    return folder


def signed_copy(signed: Path, tmp_path: Path) -> Path:
    """A private copy of the signed artifacts folder (its build only) to tamper with."""
    copy = tmp_path / "artifacts"
    shutil.copytree(the_build(signed), copy / the_build(signed).name)
    return copy


def one_line(result, *needles: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def run(artifacts: Path, weights: Path, tmp_path: Path, *keys: Path):
    trusted = [arg for key in keys for arg in ("--trusted-key", str(key))]
    out = tmp_path / "v.mp4"
    args = [
        "run",
        "--artifacts",
        str(artifacts),
        "--weights",
        str(weights),
        *RUN,
        "--out",
        str(out),
    ]
    return run_cli("runtime", *args, *trusted, check=False)


def test_keygen_writes_a_private_key_only_its_owner_reads(keys):
    assert stat.S_IMODE(os.stat(keys["builder"]).st_mode) == 0o600
    assert (
        signing.load_signing_key(keys["builder"]).key_id
        == signing.load_trusted_key(keys["builder.pub"]).key_id
    )
    result = run_cli("aot", "keygen", "--out", str(keys["builder"]), check=False)
    one_line(result, "exists", "never overwritten")


def test_a_signed_build_records_its_key_and_runs(signed, keys, tiny_weights, tmp_path):
    build = the_build(signed)
    key_id = signing.load_trusted_key(keys["builder.pub"]).key_id
    assert read_manifest(build).signed_by == key_id
    assert json.loads((build / "manifest.sig").read_text())["key_id"] == key_id
    entries = sorted((signed / store.STORE).iterdir())
    assert entries and all(
        json.loads((e / "entry.sig").read_text())["key_id"] == key_id for e in entries
    )
    # Trusted among others; the control: the same command without the key in the list fails.
    result = run(signed, tiny_weights, tmp_path, keys["other.pub"], keys["builder.pub"])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "v.mp4").stat().st_size > 0
    one_line(run(signed, tiny_weights, tmp_path, keys["other.pub"]), "not by a trusted key")


def _edit_manifest(build: Path) -> None:
    raw = json.loads((build / MANIFEST).read_text())
    raw["notes"] = ["edited after signing"]
    (build / MANIFEST).write_text(json.dumps(raw))


def _unsigned(build: Path) -> None:
    (build / "manifest.sig").unlink()


def _executable_replaced(build: Path) -> None:
    """A pickle in place of an executable, the manifest's sha256 recomputed to match it (as
    whoever can write the folder could): only the signature can tell."""
    exe = build / "kv_cache.exec"
    exe.write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.")
    raw = json.loads((build / MANIFEST).read_text())
    raw["programs"]["kv_cache"]["executable"].update(
        sha256=sha256_file(exe), size=exe.stat().st_size
    )
    (build / MANIFEST).write_text(json.dumps(raw))


def _signed_by_another(build: Path, keys: dict[str, Path]) -> None:
    signing.sign(build / MANIFEST, signing.load_signing_key(keys["other"]))


def _signature_garbled(build: Path) -> None:
    (build / "manifest.sig").write_text(
        '{"algorithm": "ed25519", "key_id": "x", "signature": "%%"}'
    )


def _signature_a_fifo(build: Path) -> None:
    (build / "manifest.sig").unlink()
    os.mkfifo(build / "manifest.sig")


TAMPERING = {
    "manifest edited": (_edit_manifest, "does not match its signature"),
    "unsigned": (_unsigned, "is not signed"),
    "an executable replaced, its sha256 recomputed": (_executable_replaced, "does not match its signature"),
    "signed by another key": (lambda b: None, "not by a trusted key"),
    "signature garbled": (_signature_garbled, "no base64 signature"),
    "signature a FIFO": (_signature_a_fifo, "not a regular file"),
}  # fmt: skip


@pytest.mark.parametrize("how", sorted(TAMPERING))
def test_a_tampered_build_is_refused_before_any_executable_is_read(
    signed, keys, tiny_weights, tmp_path, how
):
    artifacts = signed_copy(signed, tmp_path)
    tamper, message = TAMPERING[how]
    if how == "signed by another key":
        _signed_by_another(the_build(artifacts), keys)
    else:
        tamper(the_build(artifacts))
    line = one_line(run(artifacts, tiny_weights, tmp_path, keys["builder.pub"]), message)
    assert "runtime's format" not in line  # the planted executable was never read
    assert not (tmp_path / "v.mp4").exists()


def test_aot_check_verifies_a_folder(signed, keys, tiny_build, tmp_path):
    """A signed folder passes; beside an unsigned build, that build is a signature violation
    (exit 1), and a bad key file is one line (exit 2)."""
    assert (
        run_cli("aot", "check", str(signed), "--trusted-key", str(keys["builder.pub"])).returncode
        == 0
    )
    artifacts = signed_copy(signed, tmp_path)
    shutil.copytree(tiny_build, artifacts / "unsigned")
    result = run_cli(
        "aot", "check", str(artifacts), "--trusted-key", str(keys["builder.pub"]), check=False
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is not signed" in result.stdout and "1 violation(s) in 1 of 2 build(s)" in result.stdout
    one_line(
        run_cli("aot", "check", str(signed), "--trusted-key", str(keys["builder"]), check=False),
        "not a PEM public key",
    )


def test_serve_refuses_an_unsigned_build_before_loading(tiny_build, tiny_weights, keys, tmp_path):
    result = run_cli(
        "runtime", "serve", "--artifacts", str(tiny_build.parent), "--weights", str(tiny_weights),
        "--out-dir", str(tmp_path / "jobs"), "--port", "0", "--trusted-key", str(keys["builder.pub"]),
        check=False,
    )  # fmt: skip
    one_line(result, "is not signed")


def test_another_key_rebuilds_and_signs_again(signed, keys, tmp_path):
    """A build or store entry signed by another key is not up to date for --sign-key: each is
    made again and signed by the new key (the store's entries are never trusted unsigned)."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(signed, artifacts)
    result = run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8",
                     "--out", str(artifacts), "--sign-key", str(keys["other"]), "--jobs", "1")  # fmt: skip
    assert "1 built, 0 up to date" in result.stdout, result.stdout + result.stderr
    assert "stored entry damaged, recompiling" in result.stderr and " reused" not in result.stderr
    other = signing.load_trusted_key(keys["other.pub"]).key_id
    assert read_manifest(the_build(artifacts)).signed_by == other
    for entry in (artifacts / store.STORE).iterdir():
        assert json.loads((entry / "entry.sig").read_text())["key_id"] == other
    again = run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8",
                    "--out", str(artifacts), "--sign-key", str(keys["other"]))  # fmt: skip
    assert "all 1 builds are up to date" in again.stdout


def test_hostile_signature_files_are_one_line(tmp_path, keys):
    signed_file = tmp_path / MANIFEST
    signed_file.write_text("{}")
    trusted = [signing.load_trusted_key(keys["builder.pub"])]
    for content in ["", "[]", "{" * 100000, '{"algorithm": "rsa", "key_id": "a", "signature": "AA=="}',
                    "x" * (signing.MAX_SIGNATURE_BYTES + 1)]:  # fmt: skip
        (tmp_path / "manifest.sig").write_text(content)
        with pytest.raises(ArtifactError) as refused:
            signing.verify(signed_file, b"{}", trusted)
        assert "\n" not in str(refused.value)
