"""What tests share: builders of tiny models and inputs, references, the CLI as tests drive it.
Reached as `support` through pytest's pythonpath (pyproject.toml); nothing here imports a test."""
