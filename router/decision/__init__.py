"""The routing decision core: pure and synchronous, time passed in; no transport, no
asyncio (tests/unit/test_layers.py). The live router and the simulator call it alike."""
