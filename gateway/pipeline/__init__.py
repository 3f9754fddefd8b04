"""The path of one request as domain steps (ARCHITECTURE.md): single-flight, native passthroughs."""
