"""serialization."""
