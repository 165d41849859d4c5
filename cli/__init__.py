"""The `pagedserve` command, above everything: it starts the API and workers, prepares models, migrates the store."""
