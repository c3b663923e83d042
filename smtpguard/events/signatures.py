"""The signature checks of §13, each exactly as its provider documents it, on `cryptography`.

Every function returns True or False and raises nothing for a bad signature or key: a
request that does not verify is a 401, whatever was wrong with it.
"""

from __future__ import annotations

import base64
import binascii
import hmac as std_hmac

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.serialization import load_der_public_key
from cryptography.x509 import load_pem_x509_certificates


def _hmac_sha256(key: bytes, message: bytes) -> bytes:
    h = hmac.HMAC(key, hashes.SHA256())
    h.update(message)
    return h.finalize()


def _ascii(*values: str) -> bool:
    """Signed fields are ASCII in every scheme here; anything else cannot verify (and must
    not reach encode() or compare_digest(), which raise on it)."""
    return all(v.isascii() for v in values)


def mailgun(signing_key: str, timestamp: str, token: str, signature: str) -> bool:
    """Hex HMAC-SHA256 of timestamp + token, keyed with the webhook signing key."""
    if not _ascii(timestamp, token, signature):
        return False
    expected = _hmac_sha256(signing_key.encode(), (timestamp + token).encode()).hex()
    return std_hmac.compare_digest(expected.encode(), signature.strip().lower().encode())


def svix(secret: str, msg_id: str, timestamp: str, body: bytes, header: str) -> bool:
    """Any `v1,<base64>` of the space-separated list is HMAC-SHA256 of `id.timestamp.body`,
    keyed with the base64 secret after `whsec_` (several while a secret is rotated)."""
    if not _ascii(msg_id, timestamp, header):
        return False
    try:
        key = svix_key(secret)
    except KeyProblem:
        return False
    expected = base64.b64encode(_hmac_sha256(key, f"{msg_id}.{timestamp}.".encode() + body))
    for part in header.split():
        version, _, value = part.partition(",")
        if version == "v1" and std_hmac.compare_digest(expected, value.encode()):
            return True
    return False


def svix_key(secret: str) -> bytes:
    try:
        return base64.b64decode(secret.strip().removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        raise KeyProblem("the secret is not whsec_ followed by base64") from None


class KeyProblem(Exception):
    """A configured key or certificate that cannot be loaded: a config error, not a 401."""


def sendgrid_key(public_key_b64: str) -> ec.EllipticCurvePublicKey:
    """The Event Webhook verification key as SendGrid shows it: base64 of its DER form."""
    try:
        key = load_der_public_key(base64.b64decode(public_key_b64.strip(), validate=True))
    except (binascii.Error, ValueError) as e:
        raise KeyProblem(f"not a base64 DER public key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise KeyProblem("not an ECDSA P-256 public key")
    return key


def sendgrid(key: ec.EllipticCurvePublicKey, timestamp: str, body: bytes, signature_b64: str) -> bool:
    """ECDSA P-256 with SHA-256 over the timestamp header followed by the raw body."""
    if not _ascii(timestamp, signature_b64):
        return False
    try:
        signature = base64.b64decode(signature_b64.strip(), validate=True)
        key.verify(signature, timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    except (binascii.Error, ValueError, InvalidSignature):
        return False
    return True


def sns_certificates(pem: bytes) -> list[rsa.RSAPublicKey]:
    """The keys of every certificate in the file: AWS rotates its SNS signing certificate,
    so the file may hold the current one and the next one side by side."""
    try:
        certificates = load_pem_x509_certificates(pem)
    except ValueError as e:
        raise KeyProblem(f"not a PEM certificate: {e}") from None
    keys = []
    for certificate in certificates:
        key = certificate.public_key()
        if not isinstance(key, rsa.RSAPublicKey):
            raise KeyProblem("a certificate's key is not RSA")
        keys.append(key)
    return keys


def sns(keys: list[rsa.RSAPublicKey], version: str, canonical: bytes, signature_b64: str) -> bool:
    """SignatureVersion 1 is SHA1withRSA, 2 is SHA256withRSA, over the canonical string,
    made with any of the configured certificates' keys."""
    algorithm: hashes.HashAlgorithm
    if version == "1":
        algorithm = hashes.SHA1()
    elif version == "2":
        algorithm = hashes.SHA256()
    else:
        return False
    if not _ascii(signature_b64):
        return False
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    for key in keys:
        try:
            key.verify(signature, canonical, padding.PKCS1v15(), algorithm)
        except (ValueError, InvalidSignature):
            continue
        return True
    return False


def basic_auth(header: str, username: str, password: str) -> bool:
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not _ascii(encoded):
        return False
    try:
        given = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    user, sep, secret = given.partition(b":")
    # Both compared, always: the time taken says nothing about which one was wrong.
    user_ok = std_hmac.compare_digest(user, username.encode())
    secret_ok = std_hmac.compare_digest(secret, password.encode())
    return bool(sep) and user_ok and secret_ok
