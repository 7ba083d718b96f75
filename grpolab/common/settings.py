"""What every settings section shares: the base class (unknown keys refused) and the error a refused config
raises. Each section lives beside the code that reads it (``grpolab.rollout.settings``, ``grpolab.models.settings``,
...); ``grpolab.config`` assembles them into a run's config."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot run; the message has one line per problem."""


class Section(BaseModel):
    """A table of a run's TOML file: a key it does not declare is refused (with the closest name)."""

    model_config = ConfigDict(extra="forbid")
