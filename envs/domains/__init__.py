"""Task domains; each module registers itself in `envs/domains/__init__.py`."""
