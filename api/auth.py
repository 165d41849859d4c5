"""API keys: creation, hashing and the bearer-token dependency that resolves the caller's key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.db import get_session
from api.models import ApiKey
from api.ratelimit import check_request_rate

TOKEN_PREFIX = "psk"
_bearer = HTTPBearer(auto_error=False, description="API key created by `pagedserve create-key`")


def hash_key(token: str) -> str:
    """SHA-256 hex digest of a full API key (keys are random, so a fast hash suffices)."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_api_key(session: Session, name: str) -> tuple[ApiKey, str]:
    """Store a new key and return it with its plaintext token, which is shown only once."""
    lookup = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}_{lookup}_{secrets.token_urlsafe(32)}"
    key = ApiKey(name=name, lookup=lookup, key_hash=hash_key(token))
    session.add(key)
    session.commit()
    return key, token


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
