"""API keys: creation, rotation, revocation, hashing and the bearer-token dependency that resolves the caller's key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.ratelimit import check_request_rate
from core.db import get_session
from core.models import ApiKey, utcnow
from core.settings import get_settings

TOKEN_PREFIX = "psk"
CHOSEN_LOOKUP_MARK = "="  # begins the lookup of an --api-key token's row; a psk_ lookup is hex
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


def create_api_key(session: Session, name: str, priority_floor: int | None = None) -> tuple[ApiKey, str]:
    """Store a new key and return it with its plaintext token; both are shown only once, like its webhook_secret.
    Without a priority floor of its own the key follows the server's."""
    key = ApiKey(name=name, webhook_secret=new_webhook_secret(), priority_floor=priority_floor)
    token = _set_new_token(key)
    session.add(key)
    session.commit()
    return key, token


def rotate_api_key(session: Session, key: ApiKey, token: bool) -> str | None:
    """Give a live key a new webhook secret and, when token is true, a new bearer token (returned; the old one
    stops)."""
    if key.revoked_at is not None:
        raise ValueError(f"API key {key.id} was revoked at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC; create a new one")
    if token and is_chosen_key(key):
        raise ValueError(f"API key {key.id}'s token is the one given with --api-key; start the API with another")
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


def _configured_token(token: str) -> bool:
    """Whether the token is one the server was started with (--api-key), compared in constant time."""
    return any(hmac.compare_digest(token.encode(), chosen.encode()) for chosen in get_settings().api_key or ())


def _chosen_lookup(token: str) -> str:
    # an --api-key token is the operator's text, not psk_<lookup>_...; its row is found by its hash's prefix
    return CHOSEN_LOOKUP_MARK + hash_key(token)[:15]


def _chosen_key(session: Session, token: str) -> ApiKey:
    """The stored key of an --api-key token, created on its first use (so its jobs, files and batches are its own)."""
    lookup = _chosen_lookup(token)
    key = session.scalar(select(ApiKey).where(ApiKey.lookup == lookup))
    if key is not None:
        return key
    key = ApiKey(name="--api-key", lookup=lookup, key_hash=hash_key(token), webhook_secret=new_webhook_secret())
    session.add(key)
    try:
        session.commit()
    except IntegrityError:  # another API process created it first
        session.rollback()
        key = session.scalars(select(ApiKey).where(ApiKey.lookup == lookup)).one()
    return key


def is_chosen_key(key: ApiKey) -> bool:
    """Whether a stored key stands for an --api-key token (it works only while the server is given that token)."""
    return key.lookup.startswith(CHOSEN_LOOKUP_MARK)


def find_api_key(session: Session, token: str) -> ApiKey | None:
    """The live key matching a token, compared in constant time; None when unknown or revoked. A token given with
    --api-key is a key of its own while the server has it; a revoked one stays revoked."""
    parts = token.split("_", 2)
    key = None
    if len(parts) == 3 and parts[0] == TOKEN_PREFIX:
        key = session.scalar(select(ApiKey).where(ApiKey.lookup == parts[1]))
    if key is not None and not hmac.compare_digest(key.key_hash, hash_key(token)):
        key = None
    if key is None and _configured_token(token):
        key = _chosen_key(session, token)
    if key is None or key.revoked_at is not None or (is_chosen_key(key) and not _configured_token(token)):
        return None
    return key


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
