"""Steps of one request's path between the HTTP edge and the upstream (ARCHITECTURE.md)."""
