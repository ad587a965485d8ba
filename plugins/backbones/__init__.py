"""Built-in backbones."""
