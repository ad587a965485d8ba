"""concept's command line: click commands, rich output (data on stdout, status on stderr)."""
