"""What the model asks for: architecture (ModelSpec), bundled config catalog, Table 2 costs."""

from flexplan.workload.catalog import catalog_names, resolve_model
from flexplan.workload.model import ModelSpec

__all__ = ["ModelSpec", "catalog_names", "resolve_model"]
