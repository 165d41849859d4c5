"""SQLAlchemy 2.0 models of the job store: API keys, jobs, webhook deliveries, OpenAI files and batches."""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A random public id such as job_3f2a...; the prefix says what it names."""
    return f"{prefix}_{uuid.uuid4().hex}"


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC)


class JobStatus(str, enum.Enum):
    """Lifecycle of a job: queued → running → succeeded | failed | cancelled."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        """Whether no further transition can happen."""
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class DeliveryStatus(str, enum.Enum):
    """State of one webhook delivery across its attempts."""

    pending = "pending"
    delivered = "delivered"
    failed = "failed"


class Base(DeclarativeBase):
    """Declarative base of the job store."""


class ApiKey(Base):
    """A bearer API key (only its SHA-256 hash is stored) and its webhook signing secret; jobs belong to a key."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    name: Mapped[str] = mapped_column(String(200))
    lookup: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    webhook_secret: Mapped[str] = mapped_column(String(64))  # signs this key's webhooks; the service must read it
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # the most urgent priority the key's jobs run at; None follows the server's --priority-floor
    priority_floor: Mapped[int | None] = mapped_column(Integer)


class Job(Base):
    """One generation job: its request, its lifecycle timestamps and its result."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("api_key_id", "idempotency_key", name="uq_jobs_key_idempotency"),
        Index("ix_jobs_owner_created", "api_key_id", "created_at", "id"),
        Index("ix_jobs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    status: Mapped[JobStatus] = mapped_column(Enum(JobStatus, native_enum=False, length=16), default=JobStatus.queued)
    prompt: Mapped[str] = mapped_column(Text)
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(JSON)  # given as ids: the engine gets these
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    webhook_url: Mapped[str | None] = mapped_column(String(2048))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(255))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    # of those, the ones whose K/V the engine's prefix cache served (recorded with the result)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    output: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    deliveries: Mapped[list[WebhookDelivery]] = relationship(
        back_populates="job", order_by="WebhookDelivery.created_at"
    )


class WebhookDelivery(Base):
    """One event to deliver to a job's webhook URL, retried until delivered or out of attempts."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (UniqueConstraint("job_id", "event", name="uq_deliveries_job_event"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("whd"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    event: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(2048))
    status: Mapped[DeliveryStatus] = mapped_column(
        Enum(DeliveryStatus, native_enum=False, length=16), default=DeliveryStatus.pending
    )
    num_attempts: Mapped[int] = mapped_column(Integer, default=0)
    # No attempt starts before this: the retry's backoff, or the claim of an attempt in flight (None: due now).
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    job: Mapped[Job] = relationship(back_populates="deliveries")
    attempts: Mapped[list[WebhookAttempt]] = relationship(
        back_populates="delivery", order_by="WebhookAttempt.attempt_number"
    )


class WebhookAttempt(Base):
    """One HTTP attempt of a webhook delivery and what came of it."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"), index=True)
    attempt_number: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    delivery: Mapped[WebhookDelivery] = relationship(back_populates="attempts")


class BatchStatus(str, enum.Enum):
    """OpenAI's batch states: validating → in_progress → finalizing → completed, or failed, expired, cancelled."""

    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


class StoredFile(Base):
    """A file of the OpenAI Files API: an uploaded batch input, or a batch's output or error file."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_owner_created", "api_key_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # loaded only when read
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # a deleted file keeps its row (batches name it) but not its content
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Batch(Base):
    """An OpenAI batch: one input file whose lines became jobs, and the output files made when they finished."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_owner_created", "api_key_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    status: Mapped[BatchStatus] = mapped_column(Enum(BatchStatus, native_enum=False, length=16))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # None: made before windows were kept
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class BatchRequest(Base):
    """One line of a batch's input: its custom_id and the job it became, or the error that kept it from one."""

    __tablename__ = "batch_requests"
    __table_args__ = (UniqueConstraint("batch_id", "line_number", name="uq_batch_requests_line"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    line_number: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)  # a job's batch, when it ends
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
