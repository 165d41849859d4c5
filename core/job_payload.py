"""A job as the API shows it and as webhooks send it: the one schema both the API and the workers render."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.models import JobStatus

# A failed job's error starts with this when the engine refused the request itself (it can never run: too many
# KV blocks, parameters the engine refuses): the client's to change, so OpenAI routes answer 400, not 500.
REFUSED = "refused: "


class Choice(BaseModel):
    """One generated completion of a job."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop_token_ids token or stop string that ended it (None: EOS...)
    logprobs: Any = None
    prompt_logprobs: Any = None  # with the prompt_logprobs parameter: per prompt token (None for the first)


class JobOut(BaseModel):
    """A job as the API shows it."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    status: JobStatus
    prompt: str
    messages: list[dict[str, Any]] | None
    params: dict[str, Any]
    priority: int
    metadata: dict[str, Any] | None = Field(validation_alias="metadata_")
    webhook_url: str | None
    attempts: int
    prompt_tokens: int | None
    cached_prompt_tokens: int | None = None  # prompt tokens the engine's prefix cache served
    completion_tokens: int | None
    text: str | None = None
    choices: list[Choice] | None = Field(None, validation_alias="output")
    error: str | None
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None

    @model_validator(mode="after")
    def _first_text(self) -> JobOut:
        if self.choices:
            self.text = self.choices[0].text
        return self
