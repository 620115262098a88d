"""streamvqa: what the gateway and the worker share, and the launcher behind `make run`."""
