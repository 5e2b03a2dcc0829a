"""Base algorithms: how the clients' updates become the next model(s)."""
