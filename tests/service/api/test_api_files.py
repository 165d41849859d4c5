"""The Files and Batch APIs under one tenant's pressure: streamed size and line limits, deletion, quotas, job caps."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.errors import ApiError
from api.file_upload import read_jsonl_upload
from core.settings import Settings, configure

Headers = Callable[[str], dict[str, str]]


def _model_id(client: TestClient, headers: dict[str, str]) -> str:
    return client.get("/v1/models", headers=headers).json()["data"][0]["id"]


def _batch_file(model: str, num_lines: int) -> bytes:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "Hi", "max_tokens": 2}} for i in range(num_lines)]
    return "\n".join(json.dumps(line) for line in lines).encode()


def _upload(client: TestClient, headers: dict[str, str], content: bytes) -> Any:
    return client.post("/v1/files", headers=headers, data={"purpose": "batch"},
                       files={"file": ("in.jsonl", content, "application/jsonl")})


@pytest.fixture
def limited(service_settings: Settings) -> Iterator[TestClient]:
    """An app whose keys may have 2 jobs in flight, 2 files, 4 KiB of files and 5 lines per batch file."""
    settings = service_settings.model_copy(update={
        "max_inflight_jobs_per_key": 2, "max_files_per_key": 2, "max_file_storage_bytes_per_key": 4096,
        "max_batch_lines": 5})
    with TestClient(create_app(settings)) as client:
        yield client
    configure(service_settings)


def test_a_batch_counts_toward_the_in_flight_cap(limited: TestClient, new_auth_headers: Headers) -> None:
    headers = new_auth_headers("batch-cap")
    file_id = _upload(limited, headers, _batch_file(_model_id(limited, headers), 3)).json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    refused = limited.post("/v1/batches", json=body, headers=headers)
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert "too many jobs in flight" in refused.json()["error"]["message"]
    assert limited.get("/v1/jobs", headers=headers).json()["data"] == []


def test_an_upload_past_the_line_limit_is_413(limited: TestClient, new_auth_headers: Headers) -> None:
    headers = new_auth_headers("lines")
    response = _upload(limited, headers, _batch_file("m", 6))
    assert response.status_code == 413 and "at most 5 requests" in response.json()["error"]["message"]


def test_an_upload_stops_reading_at_the_first_line_past_the_limit() -> None:
    line = b'{"custom_id": "r"}\n'
    upload = io.BytesIO(line * 100_000)
    with pytest.raises(ApiError, match="at most 10 requests") as refused:
        read_jsonl_upload(upload, max_bytes=10 << 20, max_lines=10)
    assert refused.value.status_code == 413 and upload.tell() < len(line) * 10_000


def test_an_upload_stops_reading_at_the_size_limit() -> None:
    upload = io.BytesIO(b'{"a": "' + b"x" * (1 << 20) + b'"}')
    with pytest.raises(ApiError, match="larger than the limit of 4096 bytes") as refused:
        read_jsonl_upload(upload, max_bytes=4096, max_lines=10)
    assert refused.value.status_code == 413 and upload.tell() < 1 << 18


def test_an_oversized_chunked_upload_is_413(client: TestClient, auth_headers: dict[str, str],
                                            service_settings: Settings) -> None:
    boundary = "psboundary"

    def multipart() -> Iterator[bytes]:
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
               f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n').encode()
        for _ in range(service_settings.max_file_bytes // (1 << 16) + 2):
            yield b"x" * (1 << 16)
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {**auth_headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    response = client.post("/v1/files", content=multipart(), headers=headers)
    assert response.status_code == 413


def test_a_deleted_file_is_gone_and_answered_in_openai_shape(
    client: TestClient, auth_headers: dict[str, str], new_auth_headers: Headers
) -> None:
    file_id = _upload(client, auth_headers, _batch_file("m", 1)).json()["id"]
    assert client.delete(f"/v1/files/{file_id}", headers=new_auth_headers("not-owner")).status_code == 404
    response = client.delete(f"/v1/files/{file_id}", headers=auth_headers)
    assert response.status_code == 200
    assert response.json() == {"id": file_id, "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{file_id}", headers=auth_headers).status_code == 404
    assert client.get(f"/v1/files/{file_id}/content", headers=auth_headers).status_code == 404
    assert file_id not in [f["id"] for f in client.get("/v1/files", headers=auth_headers).json()["data"]]
    assert client.delete(f"/v1/files/{file_id}", headers=auth_headers).status_code == 404


def test_a_batch_keeps_the_id_of_its_deleted_input_file(client: TestClient, auth_headers: dict[str, str]) -> None:
    file_id = _upload(client, auth_headers, _batch_file(_model_id(client, auth_headers), 1)).json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch_id = client.post("/v1/batches", json=body, headers=auth_headers).json()["id"]
    assert client.delete(f"/v1/files/{file_id}", headers=auth_headers).status_code == 200
    batch = client.get(f"/v1/batches/{batch_id}", headers=auth_headers)
    assert batch.status_code == 200 and batch.json()["input_file_id"] == file_id
    gone = client.post("/v1/batches", json=body, headers=auth_headers)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "input_file_id"  # as the request names it


def test_the_file_count_quota_refuses_uploads_until_a_file_is_deleted(
    limited: TestClient, new_auth_headers: Headers
) -> None:
    headers = new_auth_headers("count-quota")
    first, _ = (_upload(limited, headers, _batch_file("m", 1)).json()["id"] for _ in range(2))
    refused = _upload(limited, headers, _batch_file("m", 1))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "file"
    assert "the most allowed is 2" in refused.json()["error"]["message"]
    assert _upload(limited, new_auth_headers("count-quota-other"), _batch_file("m", 1)).status_code == 200
    limited.delete(f"/v1/files/{first}", headers=headers)
    assert _upload(limited, headers, _batch_file("m", 1)).status_code == 200


def test_the_byte_quota_refuses_an_upload_that_would_pass_it(limited: TestClient, new_auth_headers: Headers) -> None:
    headers = new_auth_headers("byte-quota")
    content = _batch_file("m" * 2000, 1)
    assert _upload(limited, headers, content).status_code == 200
    refused = _upload(limited, headers, content)
    assert refused.status_code == 400 and "quota of 4096 bytes" in refused.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/files/file_%00", "/v1/batches/batch_%00"])
def test_a_nul_character_in_a_file_or_batch_id_is_404(
    client: TestClient, auth_headers: dict[str, str], path: str
) -> None:
    assert client.get(path, headers=auth_headers).status_code == 404


def test_a_batch_line_with_an_out_of_vocabulary_stop_id_is_refused_and_creates_no_job(
    client: TestClient, new_auth_headers: Headers
) -> None:
    headers = new_auth_headers("batch-vocab")
    body = {"model": _model_id(client, headers), "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [10**9]}
    line = {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": body}
    file_id = _upload(client, headers, json.dumps(line).encode()).json()["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = client.post("/v1/batches", json=create, headers=headers).json()
    assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    assert client.get("/v1/jobs", headers=headers).json()["data"] == []
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=headers).text
    assert json.loads(errors)["response"]["body"]["error"]["param"] == "stop_token_ids"


def test_files_list_in_pages_that_the_openai_client_follows_to_the_end(
    client: TestClient, new_auth_headers: Headers
) -> None:
    headers = new_auth_headers("pages")
    uploaded = [_upload(client, headers, _batch_file("m", 1)).json()["id"] for _ in range(5)]
    newest_first = uploaded[::-1]
    pages, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = client.get("/v1/files", params=params, headers=headers).json()
        pages.append([f["id"] for f in page["data"]])
        assert (page["first_id"], page["last_id"]) == (pages[-1][0], pages[-1][-1])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == [newest_first[:2], newest_first[2:4], newest_first[4:]]
    oldest = client.get("/v1/files", params={"order": "asc", "limit": 3, "after": uploaded[0]}, headers=headers)
    assert [f["id"] for f in oldest.json()["data"]] == uploaded[1:4] and oldest.json()["has_more"]
    openai_client = openai.OpenAI(base_url="http://testserver/v1", api_key=headers["Authorization"].split()[1],
                                  http_client=client)
    assert [f.id for f in openai_client.files.list(limit=2)] == newest_first  # auto-paginated, and it ends
    unknown = client.get("/v1/files", params={"after": "file_nope"}, headers=headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "after"
    assert client.get("/v1/files", params={"order": "sideways"}, headers=headers).status_code in (400, 422)


def test_a_custom_id_no_store_can_hold_fails_the_batch_naming_it(
    client: TestClient, new_auth_headers: Headers
) -> None:
    headers = new_auth_headers("surrogate-ids")
    good = {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}
    bad = '{"custom_id": "c\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}'
    file_id = _upload(client, headers, f"{json.dumps(good)}\n{bad}".encode()).json()["id"]
    response = client.post("/v1/batches", headers=headers, json={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code < 500, response.text
    assert "line 2: custom_id" in response.text
    assert client.get("/v1/jobs", headers=headers).json()["data"] == []  # nothing of the batch ran
