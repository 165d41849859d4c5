"""What the API and the workers both stand on: settings, job store, lifecycle, queue, streams, logging (torch-free)."""
