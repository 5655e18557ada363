"""kiln.builder."""
