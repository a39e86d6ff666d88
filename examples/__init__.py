"""Examples of connectors built on `lifecycle` (not part of the package)."""
