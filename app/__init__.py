"""The streamvqa gateway: HTTP and WebSocket in front, Redis behind. Never imports torch."""
