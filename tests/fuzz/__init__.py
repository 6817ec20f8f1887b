"""Mutation fuzzing of the snapshot loader and every command (issue 6)."""
