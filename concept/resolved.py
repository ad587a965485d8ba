"""A built model's link to its build resolution (``concept.config.BuildResolution``: the config with each
component resolved to its class, options and provenance). "Plan" means only the plan a family writes (e.g.
``concept.planner.model.Plan``); ``model.plan`` is the old name of ``model.resolution``, kept as a deprecated
alias for code outside the library."""
from __future__ import annotations

import warnings


class Resolved:
    """Mixin of the library's models: ``resolution`` (set by the constructor) and the deprecated ``plan``."""

    resolution = None  # the BuildResolution the model was built from (None: built by hand)

    @property
    def plan(self):
        warnings.warn("model.plan is deprecated: it is the build resolution, now model.resolution "
                      "(\"plan\" means only the plan a family writes)", DeprecationWarning, stacklevel=2)
        return self.resolution
