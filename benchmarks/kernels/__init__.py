"""See benchmarks/__init__.py."""
