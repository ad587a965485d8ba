"""Built-in position schemes."""
