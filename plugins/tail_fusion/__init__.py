"""Built-in tail fusions: what a tail token takes from its segment's latest concept on its way into
the deep stack (SPEC §2.1, "tail fusion")."""
