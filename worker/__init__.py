"""pagedserve workers: the Celery app and tasks, the per-process engine service, webhook delivery."""
