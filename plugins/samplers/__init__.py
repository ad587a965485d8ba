"""Built-in samplers."""
