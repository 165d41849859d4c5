"""The `pagedserve` command: up, api, worker, prepare, migrate, keys create|list|revoke|rotate, submit, submit-file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from cli.flags import SERVER_COMMANDS, add_settings_flags, command_settings, flag_errors
from core.settings import Settings, configure

DEV_KEY_FILE = "dev-api-key"
logger = logging.getLogger("pagedserve.cli")


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by any --flags given."""
    given = {k: v for k, v in vars(args).items() if k.startswith("setting_") and v is not None}
    overrides = {k.removeprefix("setting_"): v for k, v in given.items()}
    model_tag = getattr(args, "model_tag", None)  # `pagedserve up MODEL`, as `vllm serve MODEL`
    if model_tag is not None:
        if overrides.get("model", model_tag) != model_tag:
            raise ValueError(f"the model is given twice: {model_tag!r} and --model {overrides['model']!r}")
        overrides["model"] = model_tag
    settings = Settings(**overrides)
    configure(settings)
    return settings


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process these settings."""
    values = settings.model_dump(mode="json", exclude_none=True)
    return {**os.environ, **{f"PAGEDSERVE_{k.upper()}": _env_value(v) for k, v in values.items()}}


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, list) else str(value)  # pydantic-settings reads lists as JSON


def require_migrated_store(settings: Settings, command: str) -> None:
    """Stop a command that reads the job store when its schema is not this code's (run `migrate` first)."""
    from cli import migrate

    problem = migrate.unmigrated(settings.resolved_database_url())
    if problem is not None:
        raise SystemExit(f"pagedserve {command}: {problem}")


def check_startup(settings: Settings, command: str) -> None:
    """Prepare the model (all but `api`), fail before serving, naming the setting, on values only the model or the
    engine can judge, then on a job store whose schema is not this code's (`api`, `worker`)."""
    from api.prompts import ModelUnavailableError, prompt_model

    try:
        if command != "api":
            from engine.model_files import resolve_model

            folder = resolve_model(settings.model, settings.cache_dir)  # converts a GGUF once (torch); the API cannot
        prompt_model()  # max_model_len against the model's context, the tokenizer, the chat template
        if command != "api":
            from engine.config import EngineConfig
            from engine.llm_engine import check_kv_cache_budget
            from worker.service import engine_kwargs

            check_kv_cache_budget(EngineConfig(**engine_kwargs(settings)), folder)
    except ModelUnavailableError as exc:  # only `api` gets here: it serves, /readyz saying 503, until then
        logger.warning("%s; /readyz answers 503 and jobs are refused until then", exc.__cause__)
    except ValueError as exc:
        raise SystemExit(f"pagedserve {command}: {exc}") from exc
    if command in ("api", "worker"):  # `up` migrates it itself
        require_migrated_store(settings, command)


def cmd_api(settings: Settings, _args: argparse.Namespace) -> None:
    """Serve the REST API."""
    import uvicorn

    from api.app import create_app

    check_startup(settings, "api")

    # log_config=None: uvicorn's records go to the root handler, in PAGEDSERVE_LOG_FORMAT
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info", log_config=None)


def cmd_worker(settings: Settings, _args: argparse.Namespace) -> None:
    """Run a worker with its engine."""
    from worker.main import run_worker

    check_startup(settings, "worker")

    run_worker(settings)


def cmd_prepare(settings: Settings, _args: argparse.Namespace) -> None:
    """Convert the model (a GGUF) into the cache dir once, so the API can serve it (a worker does it at start too)."""
    check_startup(settings, "prepare")
    print(f"model {settings.model} is prepared")


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> None:
    """Migrate the job store to a revision (default: head)."""
    from alembic.util import CommandError

    from cli import migrate

    try:
        migrate.upgrade(settings.resolved_database_url(), args.revision)
    except CommandError as exc:  # an unknown or unreachable revision
        sys.exit(f"pagedserve migrate: --revision {args.revision}: {exc}")
    print(f"job store at revision {args.revision}")


def dev_api_key(settings: Settings) -> str:
    """The embedded default's development key: kept in the data dir, recreated if the store lost it."""
    from api.auth import create_api_key, find_api_key
    from core.db import session_factory

    path = settings.resolved_data_dir() / DEV_KEY_FILE
    with session_factory()() as session:
        if path.exists() and find_api_key(session, path.read_text().strip()):
            return path.read_text().strip()
        token = create_api_key(session, "development")[1]
    path.touch(mode=0o600)
    path.write_text(token)
    return token


def _stop_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_up(settings: Settings, _args: argparse.Namespace) -> None:
    """Start everything on the embedded default: the model prepared, store, Redis if needed, one worker and the API;
    a worker that dies is started again."""
    from cli import migrate
    from cli.up_watch import watch
    from core.embedded_redis import redis_reachable, start_redis

    check_startup(settings, "up")
    signal.signal(signal.SIGTERM, _stop_on_signal)
    children: list[subprocess.Popen[bytes]] = []
    try:
        if not redis_reachable(settings.redis_url):
            children.append(start_redis(settings.redis_url, settings.resolved_data_dir() / "redis"))
        migrate.upgrade(settings.resolved_database_url())
        # with --api-key the server takes the operator's tokens (as vLLM's), so no development key is made
        key_line = "API keys: those given with --api-key" if settings.api_key else \
            f"development API key: {dev_api_key(settings)}"
        env = settings_env(settings)

        def start(role: str) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, "-m", "cli.main", role], env=env)

        children += [start("worker"), start("api")]
        url = f"http://{settings.host}:{settings.port}"
        print(f"pagedserve is up: {url}  (docs: {url}/docs)\n{key_line}", flush=True)
        raise SystemExit(watch(children, len(children) - 2, lambda: start("worker")))
    finally:
        for child in reversed(children):  # API first, Redis last, so accepted work reaches the queue
            child.terminate()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()


def _parser() -> argparse.ArgumentParser:
    from api.routes.version import pagedserve_version
    from cli.client import add_client_commands
    from cli.key_commands import add_key_commands
    from cli.vllm_flags import add_vllm_flags

    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pagedserve {pagedserve_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    handlers: dict[str, Callable[[Settings, argparse.Namespace], Any]] = {
        "up": cmd_up, "api": cmd_api, "worker": cmd_worker, "prepare": cmd_prepare, "migrate": cmd_migrate,
    }
    for name, handler in handlers.items():
        sub = commands.add_parser(name, help=handler.__doc__)
        sub.set_defaults(handler=handler)
    commands.choices["migrate"].add_argument("--revision", default="head")
    add_key_commands(commands)
    add_client_commands(commands)
    for name in SERVER_COMMANDS:
        commands.choices[name].add_argument(
            "model_tag", nargs="?", metavar="MODEL", help="the model to serve, as `vllm serve MODEL` (same as --model)")
        add_vllm_flags(commands.choices[name])
    for sub in _all_subparsers(commands):
        add_settings_flags(sub, command_settings(sub.prog.split()[1]))
    return parser


def _all_subparsers(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    found = []
    for sub in dict.fromkeys(commands.choices.values()):
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        found += _all_subparsers(nested[0]) if nested else [sub]
    return found


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `pagedserve` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        parser.error(flag_errors(exc))
    except ValueError as exc:
        parser.error(str(exc))
    from core.logging import configure_logging

    configure_logging(settings.log_format)
    if args.command in SERVER_COMMANDS:
        from cli.vllm_flags import warn_without_effect

        warn_without_effect(args)
    if args.command not in ("keys", "create-key", "migrate"):
        args.handler(settings, args)
        return
    from sqlalchemy.exc import OperationalError

    try:
        if args.command != "migrate":
            require_migrated_store(settings, args.command)
        args.handler(settings, args)
    except OperationalError as exc:  # a store that is down or refuses us: say so, not a traceback
        raise SystemExit(f"pagedserve {args.command}: the job store cannot be reached: {exc.orig}") from None


if __name__ == "__main__":
    main()
