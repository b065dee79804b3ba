"""Developer tools that are not part of a run (documentation generators)."""
