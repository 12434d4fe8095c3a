"""Prompt datasets, built-in tasks and rule rewards."""
