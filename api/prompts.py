"""The configured model as the API's requests need it: 503 with Retry-After while it is not prepared."""

from __future__ import annotations

from api.errors import ApiError
from core.model_files import ModelNotPreparedError
from core.prompts import PromptModel, configured_prompt_model
from core.settings import get_settings

MODEL_RETRY_AFTER_S = 10


class ModelUnavailableError(ApiError):
    """503 for a request that needs the model while it is not prepared (its GGUF not converted yet)."""

    def __init__(self, model: str) -> None:
        # the cause names the server's cache folder; clients only learn to retry (the API process logs the folder)
        message = f"model {model!r} is not prepared yet (a worker converts it as it starts); retry shortly"
        super().__init__(503, message, headers={"Retry-After": str(MODEL_RETRY_AFTER_S)})


def prompt_model() -> PromptModel:
    """The configured model's prompt handling; ModelUnavailableError (503) while the model is not prepared."""
    try:
        return configured_prompt_model()
    except ModelNotPreparedError as exc:
        raise ModelUnavailableError(get_settings().model) from exc
