"""The `pagedserve keys create|list|revoke|rotate` commands, run against the configured job store."""

from __future__ import annotations

import argparse
import sys

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import TOKEN_PREFIX, create_api_key, is_chosen_key, revoke_api_key, rotate_api_key
from core.db import session_factory
from core.models import ApiKey
from core.queue import MAX_PRIORITY
from core.settings import Settings


def _find_key(session: Session, key_id: str) -> ApiKey:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise SystemExit(f"key_id: no API key {key_id!r}; `pagedserve keys list` shows the ids")
    return key


def cmd_create_key(_settings: Settings, args: argparse.Namespace) -> None:
    """Create an API key; print its bearer token, then its webhook signing secret (each shown only this once)."""
    with session_factory()() as session:
        key, token = create_api_key(session, args.name, args.priority_floor)
    print(f"{token}\n{key.webhook_secret}")
    print(f"created API key {key.id} ({args.name}): line 1 is the bearer token, line 2 the webhook signing secret",
          file=sys.stderr)


def cmd_list_keys(_settings: Settings, _args: argparse.Namespace) -> None:
    """List API keys: id, token prefix, created, revoked, priority floor ("-": the server's), name (never a token
    or a secret)."""
    with session_factory()() as session:
        keys = session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)).all()
    for key in keys:
        revoked = f"{key.revoked_at:%Y-%m-%dT%H:%M:%SZ}" if key.revoked_at else "-"
        # an --api-key token's row shows the start of the token's SHA-256, which tells the rows apart
        token = f"(--api-key {key.key_hash[:8]})" if is_chosen_key(key) else f"{TOKEN_PREFIX}_{key.lookup}_..."
        floor = "-" if key.priority_floor is None else key.priority_floor
        print(f"{key.id}\t{token}\t{key.created_at:%Y-%m-%dT%H:%M:%SZ}\t{revoked}\t{floor}\t{key.name}")


def cmd_revoke_key(_settings: Settings, args: argparse.Namespace) -> None:
    """Revoke an API key: its token gets 401 from now on."""
    with session_factory()() as session:
        try:
            revoke_api_key(session, _find_key(session, args.key_id))
        except ValueError as exc:
            raise SystemExit(f"key_id: {exc}") from exc
    print(f"revoked API key {args.key_id}", file=sys.stderr)


def cmd_rotate_key(_settings: Settings, args: argparse.Namespace) -> None:
    """Give an API key a new webhook signing secret (and with --token a new bearer token); print what is new."""
    with session_factory()() as session:
        key = _find_key(session, args.key_id)
        try:
            token = rotate_api_key(session, key, token=args.token)
        except ValueError as exc:
            raise SystemExit(f"key_id: {exc}") from exc
        print(f"{token}\n{key.webhook_secret}" if token else key.webhook_secret)
    what = "bearer token (line 1) and webhook signing secret (line 2)" if token else "webhook signing secret"
    print(f"rotated the {what} of API key {args.key_id}; the old one no longer works", file=sys.stderr)


def cmd_update_key(_settings: Settings, args: argparse.Namespace) -> None:
    """Change an API key's priority floor, the most urgent priority its new jobs may have ("default": the
    server's --priority-floor); jobs already accepted keep theirs."""
    with session_factory()() as session:
        key = _find_key(session, args.key_id)
        key.priority_floor = args.priority_floor
        session.commit()
    floor = "the server's --priority-floor" if args.priority_floor is None else args.priority_floor
    print(f"API key {args.key_id}'s priority floor is now {floor}", file=sys.stderr)


def _priority_floor(text: str) -> int | None:
    """A --priority-floor value: a priority (-1000..1000), or "default" for the server's."""
    if text == "default":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from -1000 to 1000 or 'default', got {text!r}") from None
    if not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"expected an integer from -1000 to 1000 or 'default', got {value}")
    return value


def _key_name(value: str) -> str:
    """A key's name: printable text of 1 to 128 characters (a tab or newline would forge rows of `keys list`)."""
    if not 1 <= len(value) <= 128 or not value.isprintable():
        raise argparse.ArgumentTypeError(f"expected 1 to 128 printable characters (no tabs, newlines or other "
                                         f"control characters), got {value!r}")
    return value


def add_key_commands(commands: argparse._SubParsersAction) -> None:
    """Register `keys create|list|revoke|rotate` (and the older `create-key`) on the CLI."""
    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    for sub in (commands.add_parser("create-key", help=cmd_create_key.__doc__),
                keys.add_parser("create", help=cmd_create_key.__doc__)):
        sub.add_argument("--name", type=_key_name, default="default", help="what the key is for")
        sub.add_argument("--priority-floor", type=_priority_floor, default=None, metavar="N",
                         help="the most urgent priority the key's jobs may have (default: the server's "
                              "--priority-floor)")
        sub.set_defaults(handler=cmd_create_key)
    keys.add_parser("list", help=cmd_list_keys.__doc__).set_defaults(handler=cmd_list_keys)
    for name, handler in (("revoke", cmd_revoke_key), ("rotate", cmd_rotate_key)):
        sub = keys.add_parser(name, help=handler.__doc__)
        sub.add_argument("key_id", help="the key's id (key_..., from `pagedserve keys list`)")
        sub.set_defaults(handler=handler)
    update = keys.add_parser("update", help=cmd_update_key.__doc__)
    update.add_argument("key_id", help="the key's id (key_..., from `pagedserve keys list`)")
    update.add_argument("--priority-floor", type=_priority_floor, required=True, metavar="N|default",
                        help="the most urgent priority the key's jobs may have (lower runs earlier)")
    update.set_defaults(handler=cmd_update_key)
    keys.choices["rotate"].add_argument(
        "--token", action="store_true", help="also replace the bearer token (the key keeps its id and jobs)")
