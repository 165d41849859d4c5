"""pagedserve's HTTP API: routes, schemas, auth, the OpenAI layer (torch-free; stands on core, never on the worker)."""
