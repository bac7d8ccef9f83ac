"""One metrics layer (prometheus_client) for the transfer engine, the store, the proxy and the adapters."""
