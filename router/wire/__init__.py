"""HTTP/1.1 on asyncio protocols over httptools: the router's hot path without a framework
(server.py: the clients' side; client.py: the engines')."""
