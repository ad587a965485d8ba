"""Built-in attention."""
