"""The router's HTTP surfaces (aiohttp): thin adapters over the flow layer."""
