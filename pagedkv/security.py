"""Authenticated and encrypted links: the executor secret, TLS credentials, and the warnings a service logs
when it listens beyond loopback without them.

- Scheduler -> executor: a shared secret (``--executor-secret-file PATH`` or ``$PAGEDKV_EXECUTOR_SECRET``). The
  scheduler sends ``authorization: Bearer <secret>`` on every executor RPC; the executor's ``SecretInterceptor``
  refuses every RPC without it (health and reflection answer anyone) with ``UNAUTHENTICATED``.
- TLS: ``--tls-cert/--tls-key`` on a server; clients verify it with a CA (``--tls-ca``), optionally against
  another name than the address (``--tls-server-name``: the certificate's SAN).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import time
from pathlib import Path

import grpc

EXECUTOR_SECRET_ENV = "PAGEDKV_EXECUTOR_SECRET"
SECRET_FILE_FLAG = "--executor-secret-file"
# Anyone may call these (probes, grpcurl): they carry no tenant data and cannot drive the executor.
PUBLIC_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                          "/grpc.reflection.v1.ServerReflection/")
AUTH_LOG_EVERY = 1.0  # seconds: at most one auth-failure line per interval (a retrying attacker floods no log)
SECRET_HINT = (f"the scheduler's {SECRET_FILE_FLAG} (or ${EXECUTOR_SECRET_ENV}) must hold the same secret as "
               "the executor's")


# ---- the executor secret -----------------------------------------------------------------------
def _checked_secret(text: str, where: str) -> str:
    secret = text.strip()
    if not secret:
        raise ValueError(f"{where}: the executor secret is empty; write a random value into it, e.g. "
                         "python -c 'import secrets; print(secrets.token_hex(32))'")
    if not all(0x21 <= ord(c) <= 0x7E for c in secret):
        raise ValueError(f"{where}: the executor secret must be printable ASCII without spaces (it travels as "
                         "gRPC metadata); e.g. secrets.token_hex(32)")
    return secret


def read_secret(path: str, flag: str, env: str) -> tuple[str, str]:
    """A secret's raw text and where it came from: the file ``flag PATH`` names, else ``$env``; ('', '') when
    neither is set. Raises ValueError naming the file when it cannot be read."""
    if path:
        try:
            return Path(path).read_text(encoding="utf-8"), f"{flag} {path}"
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{flag} {path}: cannot read it: {err}") from err
    text = os.environ.get(env, "")
    return (text, f"${env}") if text else ("", "")


def load_executor_secret(path: str) -> str:
    """The secret from ``--executor-secret-file PATH``, else from ``$PAGEDKV_EXECUTOR_SECRET`` (unset or empty:
    none), else ''. Raises ValueError naming the file (or the variable) when it is unreadable or blank."""
    text, where = read_secret(path, SECRET_FILE_FLAG, EXECUTOR_SECRET_ENV)
    return _checked_secret(text, where) if where else ""


def bearer_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata the scheduler sends on every executor RPC (none without a secret)."""
    return (("authorization", f"Bearer {secret}"),) if secret else ()


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Lets an RPC through only with ``authorization: Bearer <secret>`` (constant-time compare); health and
    reflection answer anyone. A refusal is ``UNAUTHENTICATED`` and is logged (peer, method, reason; never what
    was presented), at most once per second for each reason, with the count of refusals since its last line."""

    def __init__(self, secret: str, log) -> None:
        self._expected = f"Bearer {secret}".encode()
        self._log = log
        self._logged_at: dict[str, float] = {}  # by reason: a missing secret does not hide a wrong one
        self._unlogged: dict[str, int] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(PUBLIC_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        presented = [v for k, v in (handler_call_details.invocation_metadata or ()) if k == "authorization"]
        if len(presented) == 1 and isinstance(presented[0], str):
            value = presented[0].encode("utf-8", "surrogateescape")
            if hmac.compare_digest(value, self._expected):
                return await continuation(handler_call_details)
        if not presented:
            reason = "no authorization metadata"
        elif len(presented) > 1:
            reason = "several authorization entries"
        elif not str(presented[0]).startswith("Bearer "):
            reason = "authorization is not 'Bearer <secret>'"
        else:
            reason = "wrong secret"
        return self._refusal(method, reason)

    def _refusal(self, method: str, reason: str) -> grpc.RpcMethodHandler:
        # NOTE: a stream-stream handler answers at once whatever the method's kind: it reads no request (a
        # unary handler would wait for one) and deserializes nothing.
        message = (f"executor authentication failed ({reason}): every RPC but health and reflection needs "
                   f"metadata 'authorization: Bearer <secret>'; {SECRET_HINT}")

        async def refuse(_requests, context) -> None:
            self._note(context.peer(), method, reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.stream_stream_rpc_method_handler(refuse)

    def _note(self, peer: str, method: str, reason: str) -> None:
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(reason, -AUTH_LOG_EVERY) < AUTH_LOG_EVERY:
            return
        self._log.warning("executor_auth_failed", peer=peer, method=method, reason=reason,
                          refused_since_last_line=self._unlogged[reason], hint=SECRET_HINT)
        self._logged_at[reason], self._unlogged[reason] = now, 0


# ---- TLS ---------------------------------------------------------------------------------------
def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it: {err}") from err
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials | None:
    """TLS credentials from ``--tls-cert/--tls-key`` (None when neither is given). The pair is checked now:
    a key that does not match the certificate is an error at start-up, not a handshake failure later."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together: give both (PEM certificate chain, PEM private key)")
    cert_pem, key_pem = _read_pem(cert, "--tls-cert"), _read_pem(key, "--tls-key")
    from pagedkv.certs import check_pair

    check_pair(cert_pem, key_pem, cert, key)
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def channel_credentials(ca: str, flag: str = "--tls-ca") -> grpc.ChannelCredentials:
    """Credentials that trust the CA certificate(s) in ``ca`` (PEM)."""
    return grpc.ssl_channel_credentials(root_certificates=_read_pem(ca, flag))


def server_name_options(server_name: str) -> list[tuple[str, str]]:
    """Channel options that verify the server's certificate against ``server_name`` instead of the address's
    host (a certificate for ``executors`` reached by IP, say)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def open_channel(target: str, options: list, tls_ca: str = "", tls_server_name: str = "",
                 ca_flag: str = "--tls-ca") -> grpc.aio.Channel:
    """A plaintext channel, or a TLS one that trusts ``tls_ca``."""
    if not tls_ca:
        if tls_server_name:
            raise ValueError("--tls-server-name needs --tls-ca (it names the certificate to verify)")
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, channel_credentials(tls_ca, ca_flag),
                                   options=[*options, *server_name_options(tls_server_name)])


# ---- start-up warnings -------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or 0.0.0.0-style wildcards below


def warn_if_exposed(log, role: str, host: str, port: int, tls: bool) -> None:
    """A loud ``insecure_listener`` line when a server listens beyond loopback without TLS."""
    if tls or is_loopback(host):
        return
    log.warning("insecure_listener", role=role, address=f"{host}:{port}",
                risk="plaintext beyond loopback: what crosses this port (API keys, the executor secret, "
                "prompts, outputs) can be read and altered on the network",
                hint="give --tls-cert/--tls-key (pagedkv gen-certs makes a CA and a server certificate), or listen "
                "on 127.0.0.1 for development")


# ---- flags -------------------------------------------------------------------------------------
def add_secret_arg(p: argparse.ArgumentParser, role: str) -> None:
    what = ("only a scheduler holding the same secret may drive this executor (health and reflection answer "
            "anyone)" if role == "executor" else "sent to every executor as 'authorization: Bearer <secret>'")
    p.add_argument(SECRET_FILE_FLAG, default="", metavar="PATH",
                   help=f"file holding the scheduler-executor shared secret: {what}. Default: "
                   f"${EXECUTOR_SECRET_ENV} (the secret itself). pagedkv gen-certs --executor-secret writes one")


def add_tls_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default="", metavar="PATH",
                   help="PEM certificate (chain) for TLS on this port (with --tls-key; pagedkv gen-certs makes one). "
                   "Without it the port is plaintext: fine on loopback, logged loudly beyond it")
    p.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert")


def add_tls_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=os.environ.get("PAGEDKV_TLS_CA", ""), metavar="PATH",
                   help="connect with TLS, trusting the CA certificate(s) in PATH (the server's --tls-cert must be "
                   "signed by it; default: $PAGEDKV_TLS_CA; none: plaintext)")
    p.add_argument("--tls-server-name", default="", metavar="NAME",
                   help="check the server's certificate against NAME instead of the address's host (when the "
                   "certificate's SANs do not name the address you connect to)")
