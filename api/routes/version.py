"""GET /version (vLLM's route): the pagedserve version serving requests."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter

router = APIRouter(tags=["health"])


def pagedserve_version() -> str:
    """The installed pagedserve package's version."""
    return version("pagedserve")


@router.get("/version")
def get_version() -> dict[str, str]:
    """The server's version, as vLLM answers it."""
    return {"version": pagedserve_version()}
