"""Built-in vocabularies."""
