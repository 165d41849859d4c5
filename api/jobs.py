"""Job operations behind the routes: create (with idempotency), read, list, cancel and delete."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from datetime import UTC, datetime

import redis
from sqlalchemy import and_, delete, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.prompts import prompt_model
from api.ratelimit import check_inflight
from api.schemas import JobCreate
from core import streams
from core.lifecycle import job_created, transition
from core.models import FINAL_STATUSES, ApiKey, BatchRequest, Job, JobStatus, WebhookAttempt, WebhookDelivery
from core.prompts import PromptFieldError, PromptTooLongError, TokenIdError
from core.settings import get_settings
from core.structured_outputs import StructuredOutputError, grammar_of
from core.webhook_urls import check_webhook_url

logger = logging.getLogger("pagedserve.api")
_JOB_ID = re.compile(r"job_[0-9a-f]{32}")  # what core.models.new_id makes
MAX_BULK_IDS = 500  # jobs one GET /v1/jobs?ids=... reads, as many as its largest page


def priority_floor(key: ApiKey) -> int:
    """The most urgent priority a key's jobs may have: its own floor, else the server's."""
    return key.priority_floor if key.priority_floor is not None else get_settings().priority_floor


def job_priority(key: ApiKey, body: JobCreate, field: str, batch_priority: int | None = None) -> int:
    """The priority a job runs at: the one asked, else 0 (a batch line's: `batch_priority`), never more urgent than
    the key's floor (an urgent job preempts other tenants' running ones, so only the operator grants urgency) nor,
    for a batch line, than the batch priority (batches yield to interactive traffic). Asking beyond either is a
    403."""
    key_floor = priority_floor(key)
    floor = key_floor if batch_priority is None else max(key_floor, batch_priority)
    if "priority" not in body.model_fields_set:
        return max(0 if batch_priority is None else batch_priority, floor)
    if body.priority < floor:
        why = (f"batch lines run at the batch priority {batch_priority} or later" if floor > key_floor else
               f"API key {key.id}'s priority floor is {key_floor} (an operator changes it with `pagedserve keys "
               f"update {key.id} --priority-floor N`)")
        raise ApiError(403, f"{field} {body.priority} is more urgent than this request may ask (lower runs "
                       f"earlier): {why}", field)
    return body.priority


def build_job(key: ApiKey, body: JobCreate, field_prefix: str = "", batch_priority: int | None = None) -> Job:
    """A new queued job (not yet stored) for a request, with its prompt rendered and checked against the context;
    a batch line (`batch_priority` given) runs at that priority or a less urgent one it asks for."""
    priority = job_priority(key, body, field_prefix + "priority", batch_priority)
    model = prompt_model()
    # unset tool fields stay out: chat templates test for the keys ('tool_calls' in message), not their values
    messages = [m.model_dump(exclude_none=True) for m in body.messages] if body.messages else None
    field = "messages" if messages else "prompt_token_ids" if body.prompt_token_ids else "prompt"
    prompt_token_ids, text = body.prompt_token_ids, None
    try:
        if prompt_token_ids is None:
            text = body.prompt if messages is None else model.render_chat(
                messages, tools=body.chat_tools(), options=body.chat_template_options())
            if body.truncate_prompt_tokens is not None:  # the ids whose start is cut
                prompt_token_ids = model.tokenizer.encode(text or "").ids
        if prompt_token_ids is not None and body.truncate_prompt_tokens is not None:
            keep = body.truncate_prompt_tokens
            keep = max(1, model.max_model_len - body.max_tokens) if keep == -1 else keep
            prompt_token_ids = prompt_token_ids[-keep:]
        if prompt_token_ids:  # kept as ids for the engine; the text is for reading back (echo, GET)
            num_prompt_tokens = model.check_fits_ids(prompt_token_ids, body.max_tokens, field_prefix + field,
                                                     field_prefix + "max_tokens")
            # PostgreSQL text cannot hold NUL, which a byte token decodes to; the engine gets the ids, so the text
            # kept for reading back shows U+FFFD there instead
            prompt = model.tokenizer.decode(prompt_token_ids, skip_special_tokens=False).replace("\x00", "\ufffd")
        else:
            prompt = text
            num_prompt_tokens = model.check_fits(prompt or "", body.max_tokens, field_prefix + field,
                                                 field_prefix + "max_tokens")
    except PromptTooLongError as exc:  # its field is prefixed already
        raise ApiError(422, str(exc), exc.field) from exc
    except PromptFieldError as exc:
        raise ApiError(422, str(exc), field_prefix + exc.field) from exc
    except ValueError as exc:
        raise ApiError(422, str(exc), field_prefix + field) from exc
    for name, token_ids in (("stop_token_ids", body.stop_token_ids), ("logit_bias", list(body.logit_bias or {})),
                            ("allowed_token_ids", body.allowed_token_ids)):
        try:
            model.check_token_ids(token_ids or [], field_prefix + name)
        except TokenIdError as exc:
            raise ApiError(422, str(exc), field_prefix + name) from exc
    try:
        model.check_samplable(body.allowed_token_ids, body.stop_token_ids or [], body.ignore_eos, body.min_tokens)
    except PromptFieldError as exc:
        raise ApiError(422, f"{field_prefix}{exc}", field_prefix + exc.field) from exc
    if body.structured_outputs is not None:
        try:
            grammar_of(body.structured_outputs.model_dump(by_alias=True))
        except StructuredOutputError as exc:
            raise ApiError(422, f"{field_prefix}{exc}", field_prefix + exc.field) from exc
    max_num_seqs = get_settings().max_num_seqs  # the workers' too where they share the settings (as under `up`)
    for name in ("n", "beam_width"):  # a worker refuses it too, but only once it takes the job (a stream has begun)
        if getattr(body, name) > max_num_seqs:
            raise ApiError(422, f"{field_prefix}{name} ({getattr(body, name)}) exceeds max_num_seqs ({max_num_seqs}), "
                           "the most sequences one engine step runs", field_prefix + name)
    if body.webhook_url:
        try:
            check_webhook_url(body.webhook_url, get_settings().webhook_allow_private)
        except ValueError as exc:
            raise ApiError(422, f"{field_prefix}{exc}", field_prefix + "webhook_url") from exc
    return Job(
        api_key_id=key.id,
        status=JobStatus.queued,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        params=body.sampling_params(),
        priority=priority,
        metadata_=body.metadata,
        webhook_url=body.webhook_url,
        prompt_tokens=num_prompt_tokens,
        attempts=0,
    )


def _request_hash(body: JobCreate) -> str:
    return hashlib.sha256(json.dumps(body.model_dump(), sort_keys=True).encode()).hexdigest()


def create_job(session: Session, key: ApiKey, body: JobCreate, idempotency_key: str | None) -> tuple[Job, bool]:
    """Persist and enqueue one job; with an idempotency key a repeat returns the first job (created=False)."""
    job = build_job(key, body)
    if idempotency_key is not None:
        existing = _idempotent_match(session, key, idempotency_key, _request_hash(body))
        if existing is not None:
            return existing, False
        job.idempotency_key, job.request_hash = idempotency_key, _request_hash(body)
    check_inflight(session, key)
    session.add(job)
    try:
        session.commit()
    except IntegrityError:  # another request with the same key won the race
        session.rollback()
        existing = _idempotent_match(session, key, idempotency_key or "", _request_hash(body))
        if existing is None:
            raise
        return existing, False
    job_created(job)
    return job, True


def _idempotent_match(session: Session, key: ApiKey, idempotency_key: str, request_hash: str) -> Job | None:
    existing = session.scalar(
        select(Job).where(Job.api_key_id == key.id, Job.idempotency_key == idempotency_key)
    )
    if existing is not None and existing.request_hash != request_hash:
        raise ApiError(409, "Idempotency-Key was already used with a different request body", "Idempotency-Key")
    return existing


def create_jobs(session: Session, key: ApiKey, bodies: Sequence[JobCreate]) -> list[Job]:
    """Persist and enqueue many jobs in one transaction: all are accepted or none."""
    jobs = [build_job(key, body, field_prefix=f"jobs.{i}.") for i, body in enumerate(bodies)]
    check_inflight(session, key, len(jobs))
    session.add_all(jobs)
    session.commit()
    for job in jobs:
        job_created(job)
    return jobs


def get_job(session: Session, key: ApiKey, job_id: str) -> Job:
    """The caller's job, or 404 (also for another key's job, so ids reveal nothing)."""
    job = session.get(Job, job_id) if "\x00" not in job_id else None  # PostgreSQL refuses NUL
    if job is None or job.api_key_id != key.id:
        raise ApiError(404, f"job {job_id} not found", "job_id")
    return job


def get_jobs(session: Session, key: ApiKey, ids: str) -> list[Job]:
    """The caller's jobs named by comma-separated ids, in that order; 422 past MAX_BULK_IDS, 404 naming unknown ids."""
    job_ids = list(dict.fromkeys(part.strip() for part in ids.split(",")))
    if not all(job_ids) or any("\x00" in job_id for job_id in job_ids):  # PostgreSQL refuses NUL
        raise ApiError(422, "ids must be job ids separated by commas, without empty entries", "ids")
    if len(job_ids) > MAX_BULK_IDS:
        raise ApiError(422, f"ids names at most {MAX_BULK_IDS} jobs, got {len(job_ids)}", "ids")
    found = {job.id: job for job in session.scalars(
        select(Job).where(Job.id.in_(job_ids), Job.api_key_id == key.id))}
    missing = [job_id for job_id in job_ids if job_id not in found]
    if missing:
        raise ApiError(404, f"jobs not found: {', '.join(missing[:10])}", "ids")
    return [found[job_id] for job_id in job_ids]


def _encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created_at, job_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        moment = datetime.fromisoformat(created_at)
        # only what _encode_cursor writes: an aware time the store can compare (not year 1 less an offset), a job id
        if moment.tzinfo is None or not _JOB_ID.fullmatch(str(job_id)):
            raise ValueError(cursor)
        return moment.astimezone(UTC), str(job_id)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ApiError(422, "cursor is not a value returned as next_cursor", "cursor") from exc


def list_jobs(
    session: Session, key: ApiKey, status: JobStatus | None, limit: int, cursor: str | None
) -> tuple[list[Job], str | None]:
    """A page of the caller's jobs, newest first, and the cursor of the next page."""
    query = select(Job).where(Job.api_key_id == key.id)
    if status is not None:
        query = query.where(Job.status == status)
    if cursor:
        created_at, job_id = _decode_cursor(cursor)
        query = query.where(
            or_(Job.created_at < created_at, and_(Job.created_at == created_at, Job.id < job_id))
        )
    jobs = list(session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)))
    next_cursor = _encode_cursor(jobs[limit - 1]) if len(jobs) > limit else None
    return jobs[:limit], next_cursor


def cancel_job(session: Session, key: ApiKey, job_id: str) -> Job:
    """Cancel a queued or running job: a queued one never starts, a running one is aborted by its worker."""
    job = get_job(session, key, job_id)
    cancelled = transition(session, job.id, JobStatus.cancelled, {JobStatus.queued, JobStatus.running})
    if cancelled is None:
        session.refresh(job)
        raise ApiError(409, f"job {job_id} is already {job.status.value} and cannot be cancelled", "job_id")
    streams.request_cancel(streams.redis_client(), job.id)
    return cancelled


def delete_job(session: Session, job: Job, described_as: str, field: str, cancel_path: str) -> None:
    """Delete a finished job for good: its row, its webhook deliveries with their attempts (a delivery not yet made is
    dropped), and its event streams. 409 naming ``field`` while it is queued or running (``cancel_path`` cancels it)
    and for a batch's job (a batch's output file is built from its jobs, and batches are never deleted); 404 when
    another request deleted it first."""
    if not job.status.is_final:
        raise ApiError(409, f"{described_as} has not finished: cancel it first (POST {cancel_path}), then delete it",
                       field)
    batch_id = session.scalar(select(BatchRequest.batch_id).where(BatchRequest.job_id == job.id).limit(1))
    if batch_id is not None:
        raise ApiError(409, f"{described_as} is a request of batch {batch_id}, whose output file is built from its "
                       "requests' jobs: it cannot be deleted", field)
    # the deliveries' rows first (PostgreSQL: a webhook attempt in flight records itself after this commit, or before
    # these deletes), so that no attempt row can appear between deleting the attempts and their deliveries
    deliveries = select(WebhookDelivery.id).where(WebhookDelivery.job_id == job.id)
    session.execute(deliveries.with_for_update())
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(deliveries)))
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.job_id == job.id))
    # a final job never moves again (a worker aborting a cancelled one only reads its cancel flag, kept)
    deleted = session.execute(delete(Job).where(Job.id == job.id, Job.status.in_(FINAL_STATUSES))).rowcount
    session.commit()
    if deleted == 0:
        raise ApiError(404, f"{described_as} not found", field)
    try:
        streams.delete_job_streams(streams.redis_client(), job.id)
    except redis.RedisError as exc:  # the job is gone from the store; its streams expire on their own
        logger.warning("job.streams_not_deleted job_id=%s error=%r", job.id, exc)
