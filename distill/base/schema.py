"""The base of every typed section: unknown keys are errors, and assignments are validated too."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
