"""Sans-IO protocol: messages, framing and pure state machines.

Nothing in this package imports trio, socket, time or random (tests/unit/test_layering.py).
"""
