"""pagedserve job service: REST API, job store, auth and enqueueing (torch-free)."""
