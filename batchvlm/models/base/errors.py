"""The errors a family raises: each is one line for the user, naming the file or job field."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model cannot be found, read or built."""


class ModelFetchError(ModelLoadError):
    """The hub could not be reached or refused for now (network, rate limit, server error): a
    later try may succeed, unlike a repo or revision that does not exist."""


class FamilyError(ValueError):
    """The job asks something of the model that it cannot do (names the job field)."""


class ConfigError(ValueError):
    """A checkpoint's config cannot be served; the family's `open` turns it into ModelLoadError
    naming the file."""
