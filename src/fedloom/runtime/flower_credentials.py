"""Credentials for a Flower deployment with TLS and SuperNode authentication.

``python -m fedloom.runtime.flower_credentials DIR --clients K [--host NAME ...]`` writes:

- ``ca.crt`` / ``ca.key``: a self-signed certificate authority (give ``ca.crt`` to every
  machine; keep ``ca.key`` off them);
- ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the CA, valid for
  ``localhost``, ``127.0.0.1`` and every ``--host`` (the names clients connect to);
- ``client_N.key`` / ``client_N.pub``: SuperNode N's EC P-384 key pair in OpenSSH's
  formats (its private key goes to that machine only; the public keys are registered with
  the SuperLink).

These are what ``flower-superlink --ssl-ca-certfile/--ssl-certfile/--ssl-keyfile
--enable-supernode-auth``, ``flwr supernode register`` and ``flower-supernode
--root-certificates --auth-supernode-private-key`` take (``fedloom serve`` and ``fedloom
join`` pass them). Written with the ``cryptography`` package rather than an openssl
script, so that it runs wherever fedloom does.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

#: how long the certificates are valid
VALID_DAYS = 365


class CredentialsError(RuntimeError):
    """The credentials folder cannot be written safely."""


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _private_pem(
    key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, openssh: bool = False
) -> bytes:
    """PKCS#8 PEM; OpenSSH's format (``ssh-keygen``'s, which ``flower-supernode`` reads)
    with ``openssh``."""
    fmt = serialization.PrivateFormat.OpenSSH if openssh else serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


def _subject_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def write_credentials(folder: Path, clients: int, hosts: Sequence[str] = ()) -> None:
    """The CA, the SuperLink's certificate for ``hosts`` and ``clients`` node key pairs
    in ``folder`` (created with mode 0700; private keys 0600 from their creation on).
    Raises :class:`CredentialsError` where a file to write exists (nothing is
    overwritten: refused before any key is written) or the folder is a link."""
    _private_folder(folder)
    names = ["ca.crt", "ca.key", "server.pem", "server.key"]
    names += [f"client_{n}.{ext}" for n in range(clients) for ext in ("key", "pub")]
    taken = [name for name in names if os.path.lexists(folder / name)]
    if taken:
        raise CredentialsError(
            f"{folder / taken[0]} exists: credentials are never overwritten (use a new folder)"
        )
    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=VALID_DAYS)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("fedloom CA"))
        .issuer_name(_name("fedloom CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server = (
        x509.CertificateBuilder()
        .subject_name(_name("fedloom SuperLink"))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(_subject_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "ca.key": _private_pem(ca_key),
        "server.pem": server.public_bytes(serialization.Encoding.PEM),
        "server.key": _private_pem(server_key),
    }
    for n in range(clients):
        key = ec.generate_private_key(ec.SECP384R1())
        files[f"client_{n}.key"] = _private_pem(key, openssh=True)
        files[f"client_{n}.pub"] = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    for name, data in files.items():
        _write_new(folder / name, data, 0o600 if name.endswith(".key") else 0o644)


def _private_folder(folder: Path) -> None:
    """``folder`` created with mode 0700 (an existing one must be a real directory of
    this user's; it is made 0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise CredentialsError(f"{folder}: not a directory (a link or a file)")
    if info.st_uid != os.getuid():
        raise CredentialsError(f"{folder}: belongs to another user")
    os.chmod(folder, 0o700)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """``data`` in a new file ``path`` with ``mode`` from its creation on: an existing
    file or link there is refused, never followed or overwritten."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise CredentialsError(f"{path} exists: credentials are never overwritten") from None
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), mode)  # the umask narrows the mode os.open gives
        out.write(data)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--clients", type=int, required=True, help="SuperNode key pairs")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="a name or IP the SuperLink is reached at (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        write_credentials(args.folder, args.clients, args.host)
    except CredentialsError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"credentials in {args.folder}")


if __name__ == "__main__":
    main()
