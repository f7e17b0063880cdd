"""``pagedkv gen-certs``: a private CA and one server certificate for TLS between clients, the scheduler and
executors (and, with ``--executor-secret``, the scheduler-executor shared secret).

Files written into ``--out``: ``ca.pem`` (what clients and the scheduler trust: ``--tls-ca``,
``--executor-tls-ca``), ``server.pem`` + ``server.key`` (``--tls-cert``/``--tls-key`` of the scheduler and the
executors), ``executor.secret`` (``--executor-secret-file``). Keys and the secret are 0600. The CA's private key
is not kept: a new host means running gen-certs again (``--force``) and handing out the new ``ca.pem``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

CA_FILE, CERT_FILE, KEY_FILE, SECRET_FILE = "ca.pem", "server.pem", "server.key", "executor.secret"
ALWAYS_HOSTS = ("localhost", "127.0.0.1", "::1")  # health checks inside a container, local clients


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the files into (created)")
    p.add_argument("--hosts", default="", metavar="A,B,...",
                   help="names and IP addresses the server certificate is valid for (its SANs), besides "
                   f"{', '.join(ALWAYS_HOSTS)}; e.g. scheduler,executors,pagedkv.example.com")
    p.add_argument("--days", type=int, default=825, help="validity of the certificates in days")
    p.add_argument("--executor-secret", action="store_true",
                   help=f"also write {SECRET_FILE}: a fresh random secret for --executor-secret-file")
    exists = p.add_mutually_exclusive_group()
    exists.add_argument("--force", action="store_true", help="replace files that exist")
    exists.add_argument("--if-missing", action="store_true",
                        help="keep existing files and exit 0 (an init container that runs on every start)")


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # an existing file keeps its old mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pagedkv"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Sequence[str]):
    from cryptography import x509

    names = []
    for host in dict.fromkeys([*hosts, *ALWAYS_HOSTS]):  # de-duplicated, in order
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _make(hosts: Sequence[str], days: int) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, server certificate, server key), PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)  # some clock skew between machines
    until = now + dt.timedelta(days=days)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pagedkv CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0] if hosts else "localhost"))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


def generate(out: Path, hosts: Sequence[str] = (), days: int = 825, executor_secret: bool = False,
             force: bool = False) -> dict[str, Path]:
    """Writes the files into ``out``; returns them by name. Raises FileExistsError unless ``force``."""
    if days < 1:
        raise ValueError(f"--days {days}: must be >= 1")
    hosts = [h.strip() for h in hosts if h.strip()]
    out.mkdir(parents=True, exist_ok=True)
    names = [CA_FILE, CERT_FILE, KEY_FILE, *([SECRET_FILE] if executor_secret else [])]
    paths = {n: out / n for n in names}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} exist: --force replaces them, --if-missing keeps them")
    ca_pem, cert_pem, key_pem = _make(hosts, days)
    _write(paths[KEY_FILE], key_pem, 0o600)
    _write(paths[CERT_FILE], cert_pem, 0o644)
    _write(paths[CA_FILE], ca_pem, 0o644)
    if executor_secret:
        _write(paths[SECRET_FILE], (secrets.token_hex(32) + "\n").encode(), 0o600)
    return paths


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    # (empty names dropped: compose passes "scheduler,executors," when $PAGEDKV_CERT_HOSTS is unset)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    wanted = [CA_FILE, CERT_FILE, KEY_FILE, *([SECRET_FILE] if args.executor_secret else [])]
    if args.if_missing and all((out / n).exists() for n in wanted):
        print(f"pagedkv gen-certs: {out} already holds {', '.join(wanted)}; kept")
        return 0
    paths = generate(out, hosts, args.days, args.executor_secret, force=args.force or args.if_missing)
    print(f"pagedkv gen-certs: wrote {', '.join(str(p) for p in paths.values())} "
          f"(server certificate for {', '.join(dict.fromkeys([*hosts, *ALWAYS_HOSTS]))})")
    return 0


def check_pair(cert_pem: bytes, key_pem: bytes, cert_path: str, key_path: str) -> None:
    """Raises ValueError when the key does not belong to the (first) certificate, or it has expired."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as err:
        raise ValueError(f"--tls-cert {cert_path}: not a PEM certificate: {err}") from err
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as err:  # TypeError: the key is encrypted
        raise ValueError(f"--tls-key {key_path}: not an unencrypted PEM private key: {err}") from err
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ValueError(f"--tls-key {key_path} is not the key of --tls-cert {cert_path}")
    if cert.not_valid_after_utc < dt.datetime.now(dt.timezone.utc):
        raise ValueError(f"--tls-cert {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
