"""Baselines that pagedserve is measured against in the same run."""
