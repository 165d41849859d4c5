"""Torch-free pieces that the API, the workers and the engine all stand on."""
