"""Built-in components of `concept`, one per file, registered through entry points."""
