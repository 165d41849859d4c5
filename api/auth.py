"""API keys: creation, rotation, revocation, hashing and the bearer-token dependency that resolves the caller's key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.ratelimit import check_request_rate
from core.db import get_session
from core.models import ApiKey, utcnow

TOKEN_PREFIX = "psk"
WEBHOOK_SECRET_PREFIX = "whsec"
_bearer = HTTPBearer(auto_error=False, description="API key created by `pagedserve keys create`")


def hash_key(token: str) -> str:
    """SHA-256 hex digest of a full API key (keys are random, so a fast hash suffices)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_webhook_secret() -> str:
    """A random webhook signing secret; receivers use the whole string, prefix included, as the HMAC key."""
    return f"{WEBHOOK_SECRET_PREFIX}_{secrets.token_urlsafe(32)}"


def _set_new_token(key: ApiKey) -> str:
    key.lookup = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}_{key.lookup}_{secrets.token_urlsafe(32)}"
    key.key_hash = hash_key(token)
    return token


def create_api_key(session: Session, name: str) -> tuple[ApiKey, str]:
    """Store a new key and return it with its plaintext token; both are shown only once, like its webhook_secret."""
    key = ApiKey(name=name, webhook_secret=new_webhook_secret())
    token = _set_new_token(key)
    session.add(key)
    session.commit()
    return key, token


def rotate_api_key(session: Session, key: ApiKey, token: bool) -> str | None:
    """Give a live key a new webhook secret and, when token is true, a new bearer token (returned; the old one
    stops)."""
    if key.revoked_at is not None:
        raise ValueError(f"API key {key.id} was revoked at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC; create a new one")
    key.webhook_secret = new_webhook_secret()
    new_token = _set_new_token(key) if token else None
    session.commit()
    return new_token


def revoke_api_key(session: Session, key: ApiKey) -> None:
    """Revoke a key: from now on its token gets 401 (its jobs stay, and their webhooks are still delivered)."""
    if key.revoked_at is not None:
        raise ValueError(f"API key {key.id} is already revoked (at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC)")
    key.revoked_at = utcnow()
    session.commit()


def find_api_key(session: Session, token: str) -> ApiKey | None:
    """The live key matching a token, compared in constant time; None when unknown or revoked."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    key = session.scalar(select(ApiKey).where(ApiKey.lookup == parts[1]))
    if key is None or key.revoked_at is not None:
        return None
    return key if hmac.compare_digest(key.key_hash, hash_key(token)) else None


def require_api_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    session: Annotated[Session, Depends(get_session)],
) -> ApiKey:
    """FastAPI dependency: the caller's API key, or 401 (429 past the key's request rate)."""
    key = find_api_key(session, credentials.credentials) if credentials else None
    if key is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    check_request_rate(key)
    return key


CurrentKey = Annotated[ApiKey, Depends(require_api_key)]
DbSession = Annotated[Session, Depends(get_session)]
