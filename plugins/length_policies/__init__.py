"""Built-in length policies."""
