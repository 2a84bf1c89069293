"""The router's HTTP surfaces, on router/wire: thin adapters over the flow layer."""
