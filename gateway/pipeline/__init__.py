"""The path of one request as domain steps (see ARCHITECTURE.md)."""
