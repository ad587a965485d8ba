"""Built-in tail fusions: what a tail token takes from its segment's latest concept on its way into
the deep stack (docs/architecture.md, "Tail fusion")."""
