"""Figures of a run (written into its run directory)."""
