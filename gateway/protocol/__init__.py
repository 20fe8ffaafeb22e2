"""Pure translation between wire formats: no I/O here."""
