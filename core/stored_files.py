"""Stored files (the Files API's rows): their purposes, and adding one (an upload, or a batch's output)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from core.models import StoredFile

BATCH_INPUT = "batch"
BATCH_OUTPUT = "batch_output"


def store_file(session: Session, owner_id: str, filename: str, purpose: str, content: bytes) -> StoredFile:
    """Add a file of the API key `owner_id` to the session (committed by the caller)."""
    stored = StoredFile(api_key_id=owner_id, filename=filename[:255], purpose=purpose, bytes=len(content),
                        content=content)
    session.add(stored)
    return stored
