"""Fixtures of the service tests: real PostgreSQL, SQLite and Redis, isolated per test module."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from api.auth import create_api_key
from cli import migrate
from core.db import session_factory
from core.settings import Settings, configure
from tests.service.receiver import WebhookReceiver

PG_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_BASE_URL = "redis://127.0.0.1:6379"
REDIS_TEST_DB = 11
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def api_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with only what the API reads: a small byte-level BPE tokenizer (a token for each of the 256
    bytes, as real ones have), a 128-token context, a chat template."""
    folder = tmp_path_factory.mktemp("api-model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    tok_config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


def _create_pg_database() -> str:
    name = f"pagedserve_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def _drop_pg_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def postgresql_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test module, dropped afterwards."""
    name = _create_pg_database()
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    _drop_pg_database(name)


@pytest.fixture(scope="module")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh SQLite file for this test module."""
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'jobs.db'}"


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest) -> str:
    """The module's job store: each module runs once on PostgreSQL and once on SQLite."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture(scope="module")
def redis_prefix() -> Iterator[str]:
    """A Redis key prefix of this module's own; its keys are deleted afterwards."""
    prefix = f"pstest:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(f"{REDIS_BASE_URL}/{REDIS_TEST_DB}")
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture(scope="module")
def service_model_dir(api_model_dir: Path) -> Path:
    """The model the module's service uses (the API-only tokenizer folder unless a conftest overrides it)."""
    return api_model_dir


@pytest.fixture(scope="module")
def service_settings(
    database_url: str, redis_prefix: str, service_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Settings]:
    """Settings for a migrated store and an isolated Redis namespace, installed for this process."""
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        database_url=database_url,
        redis_url=f"{REDIS_BASE_URL}/{REDIS_TEST_DB}",
        redis_key_prefix=redis_prefix,
        model=str(service_model_dir),
        dtype="float32",
        cpu_weight_packing="exact",  # logprobs are checked against transformers' fp32 model
        kv_cache_memory="32MiB",
        swap_space="32MiB",
        max_num_seqs=32,
        webhook_allow_private=True,
        webhook_backoff_s=0.2,
        max_body_bytes=64 * 1024,
    )
    migrate.upgrade(settings.resolved_database_url())
    configure(settings)
    yield settings
    configure(None)


def _new_auth_headers(name: str = "test", priority_floor: int | None = None) -> dict[str, str]:
    with session_factory()() as session:
        return {"Authorization": f"Bearer {create_api_key(session, name, priority_floor)[1]}"}


@pytest.fixture(scope="module")
def new_auth_headers(service_settings: Settings) -> Callable[..., dict[str, str]]:
    """Makes another API key in the module's store (name, optional priority floor); returns its Authorization
    headers."""
    return _new_auth_headers


@pytest.fixture(scope="module")
def auth_headers(service_settings: Settings) -> dict[str, str]:
    """Authorization headers of an API key made for this module."""
    return _new_auth_headers()


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    """A running local webhook receiver."""
    receiver = WebhookReceiver().start()
    yield receiver
    receiver.stop()
