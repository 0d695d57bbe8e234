"""Task domains (registered by name in `envs/registry.py`)."""
