"""The request flow: async orchestration of one request, without a transport (no aiohttp,
no gRPC): what the HTTP surfaces and the endpoint picker share."""
