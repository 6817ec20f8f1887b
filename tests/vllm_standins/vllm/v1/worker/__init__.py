"""Stand-in package (kvdbg tests only)."""
